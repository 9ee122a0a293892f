/* Row copy for kvferry's CPU gather/scatter.
 * A chunk is `nplanes` x `nrows` rows of `row_bytes`, plane-major; row r of plane q lives in the
 * cache at bases[q] + rows[r] * strides[q]. Rows are split over `nthreads` OpenMP threads; the
 * library links libgomp.so.1, the soname torch loads, so both share one thread pool.
 * Returns -1, copying nothing, if a row number is outside [0, row_limit); the caller checks
 * that the chunk buffer is large enough. */
#include <stdint.h>
#include <string.h>

int kvf_copy_table(const int64_t *bases, const int64_t *strides, int64_t nplanes, const int64_t *rows,
                   int64_t nrows, int64_t row_limit, int64_t row_bytes, int64_t chunk, int to_chunk,
                   int nthreads) {
    for (int64_t r = 0; r < nrows; r++)
        if (rows[r] < 0 || rows[r] >= row_limit)
            return -1;
    int64_t total = nplanes * nrows;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t i = 0; i < total; i++) {
        int64_t q = i / nrows, r = i % nrows;
        char *cache = (char *)(intptr_t)(bases[q] + rows[r] * strides[q]);
        char *buf = (char *)(intptr_t)(chunk + i * row_bytes);
        if (to_chunk)
            memcpy(buf, cache, (size_t)row_bytes);
        else
            memcpy(cache, buf, (size_t)row_bytes);
    }
    return 0;
}
