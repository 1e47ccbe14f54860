"""The C source of the native fold kernel (:mod:`fedagg.accumulate.native` compiles it).

Kept as a Python string, not a ``.c`` file, so that it travels wherever the package's
Python files do: a Flower app bundle (FAB, ``flwr run`` / deployment) carries only
``.py`` / ``.toml`` / ``.md`` / ... files, and a ServerApp started from one would otherwise
have no kernel to build.
"""

SOURCE = r"""/* The streaming accumulator's dense float32 fold, one pass per block (fedagg/accumulate/native.py).
 *
 * Bit-identical to the NumPy path of fedagg.accumulate.exact.Accumulator._fold_tensor:
 * per element q = rint(x * c) in float64 (round half to even), acc += q in int64; per block of
 * `block` elements the block's max |q| is added to the bound exactly as the Python code does,
 * and a block that the Python code would treat differently (a non-finite value, |q| >= 2**62,
 * bound + max |q| >= 2**62: carries or a refusal) is left untouched and handed back.
 *
 * rint: for |v| < 2**51, v + 1.5 * 2**52 lies in [2**52, 2**53) where the spacing of doubles is
 * 1, so the addition rounds v to an integer with ties to even (the default rounding mode), and
 * the integer is the difference of the bit patterns. That keeps the loop free of a
 * float-to-int conversion (not vectorisable on x86-64 without AVX-512). Blocks with larger
 * values take a careful pass with nearbyint().
 *
 * The block is added optimistically in one pass (read x, read-add-write acc) and subtracted
 * again, bit for bit (modular uint64 arithmetic), in the rare case that it has to go back.
 * With `ref` the same pass also sums (x - ref)**2 in float64 (the delta's squared L2 norm;
 * four partial sums, so its last bits may differ from NumPy's np.dot).
 *
 * No buffers: nothing but x, ref and acc is touched.
 *
 * Build: cc -O3 -fno-math-errno -ffp-contract=off -shared -fPIC [-DFEDAGG_CLONES]. Never
 * -ffast-math, and no contraction: x * c + MAGIC fused into one FMA would round once instead
 * of twice and give other integers than the NumPy path.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAGIC 6755399441055744.0 /* 1.5 * 2**52 */
#define SMALL 2251799813685248.0 /* 2**51 */
#define LANES 4
#define W 8 /* elements per vector step of block_fast: one AVX-512 register of doubles */

/* GCC / Clang vector extensions: the compiler maps them onto the target's registers (two AVX2
 * or four SSE2 / NEON registers per vector where AVX-512 is missing), so the source is portable.
 * With FEDAGG_CLONES (x86-64, GCC: the build tries it first) block_fast is compiled for
 * AVX-512, AVX2 and baseline x86-64 and the loader picks the best at run time (ifunc). */
typedef double vd __attribute__((vector_size(8 * W)));
typedef int64_t vl __attribute__((vector_size(8 * W)));
typedef float vf __attribute__((vector_size(4 * W)));

#if defined(FEDAGG_CLONES)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

static inline uint64_t bits(double d) {
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

/* rint(v) as an integer for |v| < 2**51, else 0 (the block then takes the careful pass) */
static inline uint64_t qbits(double v, uint64_t mb) {
    double vs = fabs(v) < SMALL ? v : 0.0;
    return bits(vs + MAGIC) - mb;
}

/* One block, W elements per step without branches (the vector lanes are qbits, the max and
 * the NaN test of the scalar tail below, lane by lane); `norm` is a constant in each caller,
 * so every mode gets its own loop. */
static inline __attribute__((always_inline)) int
block_body(const float *x, const float *r, const int norm, uint64_t *lo, int64_t k, double c,
           double *m_out, double *ss_out) {
    const uint64_t mb = bits(MAGIC);
    const vd zero = {0}, cv = zero + c, magic = zero + MAGIC, small = zero + SMALL;
    const vl absm = (vl){0} + INT64_MAX, mbv = (vl)magic;
    vd m = zero, ss = zero;
    vl nan = {0};
    int64_t i = 0, kk = k - k % W;
    for (; i < kk; i += W) {
        vf xf;
        vl acc;
        memcpy(&xf, x + i, sizeof xf);
        vd xd = __builtin_convertvector(xf, vd);
        vd v = xd * cv, a = (vd)((vl)v & absm);
        nan |= (a != a);
        vl gt = a > m;
        m = (vd)(((vl)a & gt) | ((vl)m & ~gt));
        vd vs = (vd)((vl)v & (a < small));
        memcpy(&acc, lo + i, sizeof acc);
        acc += (vl)(vs + magic) - mbv;
        memcpy(lo + i, &acc, sizeof acc);
        if (norm) {
            vd d = xd;
            if (norm == 2) {
                vf rf;
                memcpy(&rf, r + i, sizeof rf);
                d = xd - __builtin_convertvector(rf, vd);
            }
            ss += d * d;
        }
    }
    double mm = 0.0, s = 0.0;
    int64_t nn = 0;
    for (int l = 0; l < W; l++) {
        mm = m[l] > mm ? m[l] : mm;
        nn |= nan[l];
        s += ss[l];
    }
    for (; i < k; i++) {
        double v = (double)x[i] * c, a = fabs(v);
        nn |= (a != a);
        mm = a > mm ? a : mm;
        lo[i] += qbits(v, mb);
        if (norm) {
            double d = norm == 2 ? (double)x[i] - (double)r[i] : (double)x[i];
            s += d * d;
        }
    }
    *m_out = mm;
    *ss_out = s;
    if (nn) return 2;
    return mm < SMALL ? 0 : 1;
}

/* 0: folded, max |v| < 2**51; 1: folded only the small values (undo, careful pass);
 * 2: a NaN (undo, hand back). norm 2 needs r. */
CLONES static int block_fast(const float *x, const float *r, int norm, uint64_t *lo, int64_t k,
                             double c, double *m_out, double *ss_out) {
    if (norm == 2) return block_body(x, r, 2, lo, k, c, m_out, ss_out);
    if (norm == 1) return block_body(x, r, 1, lo, k, c, m_out, ss_out);
    return block_body(x, r, 0, lo, k, c, m_out, ss_out);
}

/* Fold x[start:n] * c into lo block by block; returns the start of the first block it left
 * to the caller (n when all were folded). *bound and *sumsq are updated for the folded blocks.
 * norm: 0 no norm, 1 sum of x**2 (ref ignored), 2 sum of (x - ref)**2. */
int64_t fedagg_fold_f32(const float *x, int64_t n, int64_t start, int64_t *lo_, double c,
                        int64_t *bound, int64_t block, int64_t lo_max,
                        const float *ref, int norm, double *sumsq) {
    uint64_t *lo = (uint64_t *)lo_;
    const uint64_t mb = bits(MAGIC);
    int64_t s = start, b = *bound;
    double tot = *sumsq;
    const float *r = norm == 2 ? ref : 0;
    if (norm == 2 && !r) norm = 1;
    while (s < n) {
        int64_t e = (n - s > block) ? s + block : n, k = e - s;
        double m, ss;
        int st = block_fast(x + s, r ? r + s : 0, norm, lo + s, k, c, &m, &ss);
        if (st == 0) {
            int64_t mi = (int64_t)((m + MAGIC) - MAGIC); /* max |rint(v)| = rint(max |v|) */
            if (mi < lo_max - b) {
                b += mi;
                tot += ss;
                s = e;
                continue;
            }
        }
        for (int64_t i = 0; i < k; i++) lo[s + i] -= qbits((double)x[s + i] * c, mb);
        if (st != 1) break;
        double mm = 0.0; /* careful pass: check first, then add (rint computed twice) */
        for (int64_t i = 0; i < k; i++) {
            double a = fabs(nearbyint((double)x[s + i] * c));
            mm = a > mm ? a : mm;
        }
        if (!(mm < (double)lo_max) || (int64_t)mm >= lo_max - b) break;
        for (int64_t i = 0; i < k; i++) lo[s + i] += (uint64_t)(int64_t)nearbyint((double)x[s + i] * c);
        b += (int64_t)mm;
        tot += ss;
        s = e;
    }
    *bound = b;
    *sumsq = tot;
    return s;
}

/* sum of (x - ref)**2 (ref NULL: of x**2) in float64, four partial sums: the delta norm of a
 * reply whose fold runs elsewhere (sharded rounds) or is not fused. */
double fedagg_sumsq_f32(const float *x, const float *r, int64_t n) {
    double ss[LANES] = {0};
    int64_t i = 0, nn = n - n % LANES;
    for (; i < nn; i += LANES) {
        for (int l = 0; l < LANES; l++) {
            double d = r ? (double)x[i + l] - (double)r[i + l] : (double)x[i + l];
            ss[l] += d * d;
        }
    }
    for (; i < n; i++) {
        double d = r ? (double)x[i] - (double)r[i] : (double)x[i];
        ss[0] += d * d;
    }
    return (ss[0] + ss[1]) + (ss[2] + ss[3]);
}

/* The mean of tensor elements [0, n) from the canonical limbs (fedagg/accumulate/exact.py,
 * mean()): v = hi * 2**31 + lo (hi NULL: v = lo) in float64, times 2**exponent (`scale`), divided
 * by the total weight, rounded to the output type; the same operations in the same order as the
 * NumPy path, so the same bits (hi * 2**31 is exact, so a fused multiply-add changes nothing).
 * out_f32 or out_f64: exactly one is non-NULL. */
void fedagg_mean(const int64_t *lo, const int64_t *hi, int64_t n, double scale, double total,
                 float *out_f32, double *out_f64) {
    for (int64_t i = 0; i < n; i++) {
        double v = hi ? (double)hi[i] * 2147483648.0 + (double)lo[i] : (double)lo[i];
        v *= scale;
        v /= total;
        if (out_f32) out_f32[i] = (float)v;
        else out_f64[i] = v;
    }
}
"""
