#include <stdint.h>
#include <string.h>
static inline uint16_t f2bf(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7FFF + ((u >> 16) & 1); return (uint16_t)(u >> 16); }
/* rows x (h heads of half bytes): out row r, head j at out + r_off[r] + j*hstride (elements, bf16) */
void kvf_dequant_nibbles(const uint8_t *q, int64_t rows, int64_t heads, int64_t half, const int64_t *row_off,
                         int64_t hstride, const float *scale, const float *bias, int64_t sb_rows_per, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *s = scale + (r / sb_rows_per) * heads * 2 * half, *b = bias + (r / sb_rows_per) * heads * 2 * half;
        for (int64_t j = 0; j < heads; j++) {
            const uint8_t *qq = q + (r * heads + j) * half;
            uint16_t *o = out + row_off[r] + j * hstride;
            const float *sj = s + j * 2 * half, *bj = b + j * 2 * half;
            for (int64_t i = 0; i < half; i++) {
                o[i] = f2bf((float)(qq[i] & 15) * sj[i] + bj[i]);
                o[i + half] = f2bf((float)(qq[i] >> 4) * sj[i + half] + bj[i + half]);
            }
        }
    }
}
