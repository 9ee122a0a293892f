/* Nibble dequantizer for the cachegen codec's CPU decode.
 * q holds, per row (one token slot of one layer), `heads` x `half` bytes: the low nibble is
 * channel i of a head's first half, the high nibble channel i of its second half. Value =
 * symbol * scale[c] + bias[c] (per layer and channel), written as bfloat16 (round to nearest
 * even) into the cache view: row r = (layer, block, slot) at out + layer * s_layer + block *
 * s_block + slot * s_slot, head j at + j * s_head, channels contiguous. Rows are split over
 * `nthreads` OpenMP threads. Plain C, no intrinsics: the compiler vectorises it for the machine's
 * baseline ISA, so it runs on any x86-64 or ARM CPU. */
#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

void kvf_dequant_nibbles(const uint8_t *q, int64_t layers, int64_t blocks, int64_t slots, int64_t heads,
                         int64_t half, const float *scale, const float *bias, uint16_t *out, int64_t s_layer,
                         int64_t s_block, int64_t s_slot, int64_t s_head, int nthreads) {
    int64_t rows = layers * blocks * slots, per_layer = blocks * slots, width = heads * 2 * half;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t r = 0; r < rows; r++) {
        int64_t layer = r / per_layer, block = (r % per_layer) / slots, slot = r % slots;
        const float *s = scale + layer * width, *b = bias + layer * width;
        uint16_t *o_row = out + layer * s_layer + block * s_block + slot * s_slot;
        const uint8_t *q_row = q + r * heads * half;
        for (int64_t j = 0; j < heads; j++) {
            const uint8_t *qq = q_row + j * half;
            uint16_t *o = o_row + j * s_head;
            const float *sj = s + j * 2 * half, *bj = b + j * 2 * half;
            for (int64_t i = 0; i < half; i++) {
                o[i] = to_bf16((float)(qq[i] & 15) * sj[i] + bj[i]);
                o[i + half] = to_bf16((float)(qq[i] >> 4) * sj[i + half] + bj[i + half]);
            }
        }
    }
}
