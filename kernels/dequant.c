/* Dequantizer for the cachegen codec's CPU decode: one call writes every layer of one KV plane.
 * Layer l's symbols start at q + q_off[l]: per row (one token slot), `heads` x `dim` symbols, with
 * bits[l] 8 one byte each, with bits[l] 4 two a byte (`heads` x `dim/2` bytes: the low nibble is
 * channel i of a head's first half, the high nibble channel i of its second half). Its bins[l]
 * give L = bins/2 - 1 (symbols span [0, 2L]); value = symbol * scale[c] + bias[c] with bias =
 * scale * -L (per layer and channel; scale at scale + l * s_scale), plus, for a layer coded as
 * deltas from anchors, its anchor row's anchor[c] (anchors[l]: float32 [runs, heads * dim], one row
 * per `run` token slots; NULL for a layer coded directly), computed in float32 and written as
 * bfloat16 (round to nearest even) at out + l * s_layer + block * s_block + slot * s_slot +
 * head * s_head + c * s_chan.
 * Two loop orders: channels contiguous (s_chan 1: a row at a time, rows split over OpenMP
 * threads), or slots contiguous (s_slot 1: vLLM CPU keeps K transposed in a block, [head_size,
 * block_size] per head: rows of TILE slots are dequantized into a small tile and written out a
 * channel at a time, so both the arithmetic and the stores run over contiguous memory; (layer,
 * block, head) planes split over threads).
 * Plain C, no intrinsics: the compiler vectorises it for the machine's baseline ISA, so it runs on
 * any x86-64 or ARM CPU. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define TILE 16
#define MAX_DIM 1024 /* a TILE x dim tile lives on the stack */

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* One head of one row, channels contiguous; `a` the head's anchors or NULL. */
static inline void head_row(const uint8_t *qq, int bits, int64_t dim, const float *s, float nl, const float *a,
                            uint16_t *o) {
    int64_t half = dim / 2;
    if (bits == 4 && a) {
        for (int64_t i = 0; i < half; i++) {
            o[i] = to_bf16((float)(qq[i] & 15) * s[i] + s[i] * nl + a[i]);
            o[i + half] = to_bf16((float)(qq[i] >> 4) * s[i + half] + s[i + half] * nl + a[i + half]);
        }
    } else if (bits == 4) {
        for (int64_t i = 0; i < half; i++) {
            o[i] = to_bf16((float)(qq[i] & 15) * s[i] + s[i] * nl);
            o[i + half] = to_bf16((float)(qq[i] >> 4) * s[i + half] + s[i + half] * nl);
        }
    } else if (a) {
        for (int64_t i = 0; i < dim; i++) o[i] = to_bf16((float)qq[i] * s[i] + s[i] * nl + a[i]);
    } else {
        for (int64_t i = 0; i < dim; i++) o[i] = to_bf16((float)qq[i] * s[i] + s[i] * nl);
    }
}

/* AVX2 where the CPU has it (about 1.3-2x on this loop), chosen when the library loads (glibc's
 * ifunc); the baseline build elsewhere. Same arithmetic in both (-mavx2 brings no FMA). */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__GLIBC__)
__attribute__((target_clones("avx2", "default")))
#endif
/* Returns 0, or -1 with nothing written: a layer's bits or bins no encoding has, symbols past
 * q_len, run < 1, an odd head size or one outside [2, MAX_DIM], or a view with neither its channels
 * nor its slots contiguous. */
int kvf_dequant(const uint8_t *q, int64_t q_len, const int64_t *q_off, const uint8_t *bins, const uint8_t *bits,
                int64_t layers, int64_t blocks, int64_t slots, int64_t heads, int64_t dim, const float *scale,
                int64_t s_scale, const float *const *anchors, int64_t run, uint16_t *out, int64_t s_layer,
                int64_t s_block, int64_t s_slot, int64_t s_head, int64_t s_chan, int nthreads) {
    int64_t width = heads * dim, half = dim / 2, rows = blocks * slots;
    if (run < 1 || dim < 2 || dim > MAX_DIM || dim % 2 || (s_chan != 1 && s_slot != 1)) return -1;
    for (int64_t l = 0; l < layers; l++) {
        int64_t levels = bins[l] / 2 - 1, need = rows * width * bits[l] / 8;
        if ((bits[l] != 4 && bits[l] != 8) || levels < 1 || (bits[l] == 4 && 2 * levels + 1 > 16) ||
            q_off[l] < 0 || q_off[l] > q_len || need > q_len - q_off[l])
            return -1;
    }
    if (s_chan == 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
        for (int64_t r = 0; r < layers * rows; r++) {
            int64_t l = r / rows, block = (r % rows) / slots, slot = r % slots;
            int64_t qhead = bits[l] == 4 ? half : dim;
            const float *s = scale + l * s_scale, *a = anchors ? anchors[l] : NULL;
            float nl = -(float)(bins[l] / 2 - 1);
            if (a) a += ((block * slots + slot) / run) * width;
            const uint8_t *qr = q + q_off[l] + (r % rows) * heads * qhead;
            uint16_t *o = out + l * s_layer + block * s_block + slot * s_slot;
            for (int64_t j = 0; j < heads; j++)
                head_row(qr + j * qhead, bits[l], dim, s + j * dim, nl, a ? a + j * dim : NULL, o + j * s_head);
        }
        return 0;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t p = 0; p < layers * blocks * heads; p++) {
        int64_t l = p / (blocks * heads), block = (p / heads) % blocks, j = p % heads;
        int64_t qhead = bits[l] == 4 ? half : dim, qrow = heads * qhead;
        const uint8_t *qb = q + q_off[l] + block * slots * qrow + j * qhead;
        const float *s = scale + l * s_scale + j * dim, *a = anchors ? anchors[l] : NULL;
        float nl = -(float)(bins[l] / 2 - 1);
        uint16_t *o = out + l * s_layer + block * s_block + j * s_head;
        uint16_t tile[TILE * dim];
        /* TILE slots at a time (fewer where an anchor run ends): rows into the tile, then each
         * channel's TILE values out in one contiguous store */
        for (int64_t t0 = 0; t0 < slots;) {
            int64_t g = block * slots + t0, n = slots - t0 < TILE ? slots - t0 : TILE;
            if (a && run - g % run < n) n = run - g % run;
            const float *ar = a ? a + (g / run) * width + j * dim : NULL;
            for (int64_t t = 0; t < n; t++) head_row(qb + (t0 + t) * qrow, bits[l], dim, s, nl, ar, tile + t * dim);
            for (int64_t c = 0; c < dim; c++)
                for (int64_t t = 0; t < n; t++) o[c * s_chan + t0 + t] = tile[t * dim + c];
            t0 += n;
        }
    }
    return 0;
}
