/* Sampling's one pass over a vocabulary: the k largest logits (a row's top-k candidates), which torch.topk takes
 * ~75 us to find among 49k on two cores, and this ~5 (engine/sampler.py). Built with the other kernels (build.py). */
#include <immintrin.h>
#include <stdint.h>

/* v at id into the best `*have` so far (values descending; an equal value goes after those already there, so the
 * lower id comes first), dropping the least where k are held. */
static inline void keep(float v, int64_t id, float *values, int64_t *ids, int64_t k, int64_t *have) {
    int64_t at = *have < k ? (*have)++ : k - 1;
    for (; at > 0 && values[at - 1] < v; at--) {
        values[at] = values[at - 1];
        ids[at] = ids[at - 1];
    }
    values[at] = v;
    ids[at] = id;
}

/* The k largest of x[0 .. n), descending, the lower id first among equals, into values[0 ..) and ids[0 ..); NaNs are
 * passed over. Returns how many it found: k, or fewer where x holds fewer numbers. One pass: 8 values at a time
 * compared with the least of those held, a value inserted only where it beats it. */
int64_t top_k(const float *x, int64_t n, int64_t k, float *values, int64_t *ids) {
    int64_t have = 0, i = 0;
    for (; i < n && have < k; i++)
        if (x[i] == x[i]) keep(x[i], i, values, ids, k, &have);
    if (have < k) return have;
    __m256 least = _mm256_set1_ps(values[k - 1]);
    for (; i + 8 <= n; i += 8) {
        unsigned m = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), least, _CMP_GT_OQ));
        if (!m) continue;
        for (; m; m &= m - 1) {
            const int64_t j = i + __builtin_ctz(m);
            if (x[j] > values[k - 1]) keep(x[j], j, values, ids, k, &have);
        }
        least = _mm256_set1_ps(values[k - 1]);
    }
    for (; i < n; i++)
        if (x[i] > values[k - 1]) keep(x[i], i, values, ids, k, &have);
    return have;
}
