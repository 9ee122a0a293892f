/* Nibble dequantizer for the cachegen codec's CPU decode.
 * q holds, per row (one token slot of one layer), `heads` x `half` bytes: the low nibble is
 * channel i of a head's first half, the high nibble channel i of its second half. Value =
 * symbol * scale[c] + bias[c] (per layer and channel), written as bfloat16 (round to nearest
 * even) into the cache view.
 * kvf_dequant_nibbles: row r = (layer, block, slot) at out + layer * s_layer + block * s_block +
 *   slot * s_slot, head j at + j * s_head, channels contiguous; rows split over OpenMP threads.
 * kvf_dequant_nibbles_t: slots contiguous and channels s_chan apart (vLLM CPU keeps K transposed
 *   in a block, [head_size, block_size] per head); one channel at a time, so the stores stay
 *   contiguous; (layer, block, head) planes split over OpenMP threads.
 * Plain C, no intrinsics: the compiler vectorises it for the machine's baseline ISA, so it runs on
 * any x86-64 or ARM CPU. */
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

void kvf_dequant_nibbles_t(const uint8_t *q, int64_t layers, int64_t blocks, int64_t slots, int64_t heads,
                           int64_t half, const float *scale, const float *bias, uint16_t *out, int64_t s_layer,
                           int64_t s_block, int64_t s_head, int64_t s_chan, int nthreads) {
    int64_t width = heads * 2 * half, qrow = heads * half, planes = layers * blocks * heads;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t p = 0; p < planes; p++) {
        int64_t layer = p / (blocks * heads), block = (p / heads) % blocks, j = p % heads;
        const uint8_t *qb = q + (layer * blocks + block) * slots * qrow + j * half;
        const float *s = scale + layer * width + j * 2 * half, *b = bias + layer * width + j * 2 * half;
        uint16_t *o = out + layer * s_layer + block * s_block + j * s_head;
        for (int64_t i = 0; i < half; i++) {
            float s0 = s[i], b0 = b[i], s1 = s[i + half], b1 = b[i + half];
            uint16_t *o0 = o + i * s_chan, *o1 = o + (i + half) * s_chan;
            for (int64_t t = 0; t < slots; t++) {
                uint8_t v = qb[t * qrow + i];
                o0[t] = to_bf16((float)(v & 15) * s0 + b0);
                o1[t] = to_bf16((float)(v >> 4) * s1 + b1);
            }
        }
    }
}
