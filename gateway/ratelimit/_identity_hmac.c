/*
 * The identity hash of gateway/ratelimit/identity.py in C: HMAC-SHA256 (RFC 2104,
 * FIPS 180-4) from the two keyed SHA-256 states, as the first 32 hex digits.
 *
 * Why: the identity HMAC runs once for every request whose key its connection has not
 * hashed yet, and in Python (two hashlib state copies, two updates, a digest, a hex
 * digest and their objects) it was the largest single cost of a proxied request
 * (~11,000 instructions of ~122,000, benchmarks/README.md). Here it is two SHA-256
 * blocks for an ordinary key and one str. identity.py falls back to the same
 * construction on hashlib when this module is not built (no C compiler, or
 * GATEWAY_COMPILE=0); tests/unit/test_identity_hmac.py checks both give hmac.new's
 * bytes for random secrets and values.
 *
 *   states(key_block: bytes) -> bytes
 *       key_block: the HMAC key padded to 64 bytes (identity.py makes it). Returns the
 *       SHA-256 states after the inner (key ^ 0x36) and outer (key ^ 0x5c) blocks: 64
 *       bytes, secret material like the key itself (kept by the IdentityHasher only).
 *   hex32(states: bytes, prefix: bytes, value: str) -> str
 *       The first 32 hex digits of HMAC-SHA256(key, prefix + value.encode()).
 *
 * Nothing here keeps anything between calls; no allocation but the result. SHA-256's
 * block function is portable C, or on x86-64 processors with the SHA extensions (CPUID
 * at import; GATEWAY_SHA_NI=0 declines them) sha256rnds2, two rounds an instruction:
 * ~4x faster than the hashlib construction there (benchmarks/README.md). valgrind does
 * not offer the extensions, so callgrind counts the portable block.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_SHA_NI_PATH 1
#endif

#define BLOCK 64
#define HEX_CHARS 32

/* memset through a volatile pointer: clearing a buffer about to go out of scope is a dead
 * store the compiler may drop; this call it cannot. */
static void *(*const volatile wipe)(void *, int, size_t) = memset;

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static uint32_t load_be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) |
           (uint32_t)p[3];
}

static void store_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

#define S0(x) (ROTR(x, 2) ^ ROTR(x, 13) ^ ROTR(x, 22))
#define S1(x) (ROTR(x, 6) ^ ROTR(x, 11) ^ ROTR(x, 25))
#define s0(x) (ROTR(x, 7) ^ ROTR(x, 18) ^ ((x) >> 3))
#define s1(x) (ROTR(x, 17) ^ ROTR(x, 19) ^ ((x) >> 10))
#define CH(x, y, z) ((z) ^ ((x) & ((y) ^ (z))))
#define MAJ(x, y, z) (((x) & (y)) | ((z) & ((x) | (y))))

/* One round, the eight working variables named by their role in it: instead of moving
 * each variable one place per round (FIPS 180-4, 6.2.2, step 3), the rounds are unrolled
 * eight at a time with the names rotated, so only d and h are written. */
#define ROUND(a, b, c, d, e, f, g, h, t)                                 \
    do {                                                                 \
        uint32_t t1 = (h) + S1(e) + CH(e, f, g) + K[t] + w[t];          \
        (d) += t1;                                                       \
        (h) = t1 + S0(a) + MAJ(a, b, c);                                 \
    } while (0)

/* One 64-byte block into the state (FIPS 180-4, 6.2.2). */
static void compress(uint32_t state[8], const unsigned char block[BLOCK]) {
    uint32_t w[64];
    for (int t = 0; t < 16; t++) {
        w[t] = load_be32(block + 4 * t);
    }
    for (int t = 16; t < 64; t++) {
        w[t] = s1(w[t - 2]) + w[t - 7] + s0(w[t - 15]) + w[t - 16];
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int t = 0; t < 64; t += 8) {
        ROUND(a, b, c, d, e, f, g, h, t);
        ROUND(h, a, b, c, d, e, f, g, t + 1);
        ROUND(g, h, a, b, c, d, e, f, t + 2);
        ROUND(f, g, h, a, b, c, d, e, t + 3);
        ROUND(e, f, g, h, a, b, c, d, t + 4);
        ROUND(d, e, f, g, h, a, b, c, t + 5);
        ROUND(c, d, e, f, g, h, a, b, t + 6);
        ROUND(b, c, d, e, f, g, h, a, t + 7);
    }
    state[0] += a;
    state[1] += b;
    state[2] += c;
    state[3] += d;
    state[4] += e;
    state[5] += f;
    state[6] += g;
    state[7] += h;
}

#ifdef HAVE_SHA_NI_PATH
/* The same block with the x86 SHA extensions (SHA-NI: two rounds an instruction), on
 * processors that have them (``use_sha_ni``, asked once at import): the message schedule
 * as above, the rounds in sha256rnds2, whose state is two registers, ABEF and CDGH. */
__attribute__((target("sha,sse4.1"))) static void compress_ni(uint32_t state[8],
                                                              const unsigned char block[BLOCK]) {
    uint32_t w[64];
    for (int t = 0; t < 16; t++) {
        w[t] = load_be32(block + 4 * t);
    }
    for (int t = 16; t < 64; t++) {
        w[t] = s1(w[t - 2]) + w[t - 7] + s0(w[t - 15]) + w[t - 16];
    }
    __m128i dcba = _mm_loadu_si128((const __m128i *)&state[0]);
    __m128i hgfe = _mm_loadu_si128((const __m128i *)&state[4]);
    __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
    __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
    __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
    __m128i abef_in = abef, cdgh_in = cdgh;
    for (int t = 0; t < 64; t += 4) {
        __m128i wk = _mm_add_epi32(_mm_loadu_si128((const __m128i *)&w[t]),
                                   _mm_loadu_si128((const __m128i *)&K[t]));
        cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
        abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));
    }
    abef = _mm_add_epi32(abef, abef_in);
    cdgh = _mm_add_epi32(cdgh, cdgh_in);
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)&state[0], _mm_blend_epi16(feba, dchg, 0xF0));
    _mm_storeu_si128((__m128i *)&state[4], _mm_alignr_epi8(dchg, feba, 8));
}

/* CPUID: SHA (leaf 7, EBX bit 29), SSE4.1 and SSSE3 (leaf 1, ECX bits 19 and 9). */
static int has_sha_ni(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 19)) || !(c & (1u << 9))) {
        return 0;
    }
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        return 0;
    }
    return (b & (1u << 29)) != 0;
}
#endif

/* The block function this process uses: set at import. */
static void (*block_fn)(uint32_t state[8], const unsigned char block[BLOCK]) = compress;

/* A SHA-256 in progress whose first ``done`` bytes (a multiple of 64) are in ``state``. */
typedef struct {
    uint32_t state[8];
    uint64_t done;
    unsigned char buf[BLOCK];
    size_t used;
} Sha;

static void sha_update(Sha *s, const unsigned char *data, size_t size) {
    if (s->used) {
        size_t take = BLOCK - s->used;
        if (take > size) {
            take = size;
        }
        memcpy(s->buf + s->used, data, take);
        s->used += take;
        data += take;
        size -= take;
        if (s->used < BLOCK) {
            return;
        }
        block_fn(s->state, s->buf);
        s->done += BLOCK;
        s->used = 0;
    }
    while (size >= BLOCK) {
        block_fn(s->state, data);
        s->done += BLOCK;
        data += BLOCK;
        size -= BLOCK;
    }
    memcpy(s->buf, data, size);
    s->used = size;
}

/* The digest (FIPS 180-4, 5.1.1 padding). */
static void sha_final(Sha *s, unsigned char out[32]) {
    uint64_t bits = (s->done + s->used) * 8;
    s->buf[s->used++] = 0x80;
    if (s->used > BLOCK - 8) {
        memset(s->buf + s->used, 0, BLOCK - s->used);
        block_fn(s->state, s->buf);
        s->used = 0;
    }
    memset(s->buf + s->used, 0, BLOCK - 8 - s->used);
    for (int i = 0; i < 8; i++) {
        s->buf[BLOCK - 1 - i] = (unsigned char)(bits >> (8 * i));
    }
    block_fn(s->state, s->buf);
    for (int i = 0; i < 8; i++) {
        store_be32(out + 4 * i, s->state[i]);
    }
}

static void sha_from(Sha *s, const unsigned char *state_bytes) {
    for (int i = 0; i < 8; i++) {
        s->state[i] = load_be32(state_bytes + 4 * i);
    }
    s->done = BLOCK; /* the key block */
    s->used = 0;
}

static PyObject *states(PyObject *module, PyObject *arg) {
    (void)module;
    if (!PyBytes_Check(arg) || PyBytes_GET_SIZE(arg) != BLOCK) {
        PyErr_SetString(PyExc_ValueError, "states() takes the 64-byte padded HMAC key");
        return NULL;
    }
    const unsigned char *key = (const unsigned char *)PyBytes_AS_STRING(arg);
    unsigned char pad[BLOCK];
    unsigned char out[2 * 32];
    for (int round = 0; round < 2; round++) {
        unsigned char x = round == 0 ? 0x36 : 0x5c;
        for (int i = 0; i < BLOCK; i++) {
            pad[i] = key[i] ^ x;
        }
        uint32_t st[8];
        memcpy(st, H0, sizeof st);
        compress(st, pad);
        for (int i = 0; i < 8; i++) {
            store_be32(out + 32 * round + 4 * i, st[i]);
        }
        wipe(st, 0, sizeof st);
    }
    PyObject *result = PyBytes_FromStringAndSize((const char *)out, sizeof out);
    /* Key material off this frame (best effort: compress's own frame is not cleared, and
     * the states live on in the IdentityHasher, as hashlib's objects did). */
    wipe(pad, 0, sizeof pad);
    wipe(out, 0, sizeof out);
    return result;
}

static PyObject *hex32(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3 || !PyBytes_Check(args[0]) || PyBytes_GET_SIZE(args[0]) != 64 ||
        !PyBytes_Check(args[1]) || !PyUnicode_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "hex32(states: 64 bytes, prefix: bytes, value: str)");
        return NULL;
    }
    Py_ssize_t size;
    const char *value = PyUnicode_AsUTF8AndSize(args[2], &size); /* str.encode()'s bytes */
    if (value == NULL) {
        return NULL; /* (a lone surrogate: UnicodeEncodeError, as str.encode() raises) */
    }
    const unsigned char *st = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    unsigned char inner[32], outer[32];
    Sha s;
    sha_from(&s, st);
    sha_update(&s, (const unsigned char *)PyBytes_AS_STRING(args[1]),
               (size_t)PyBytes_GET_SIZE(args[1]));
    sha_update(&s, (const unsigned char *)value, (size_t)size);
    sha_final(&s, inner);
    sha_from(&s, st + 32);
    sha_update(&s, inner, sizeof inner);
    sha_final(&s, outer);
    PyObject *text = PyUnicode_New(HEX_CHARS, 127);
    if (text != NULL) {
        static const char digits[] = "0123456789abcdef";
        Py_UCS1 *out = PyUnicode_1BYTE_DATA(text);
        for (int i = 0; i < HEX_CHARS / 2; i++) {
            out[2 * i] = (Py_UCS1)digits[outer[i] >> 4];
            out[2 * i + 1] = (Py_UCS1)digits[outer[i] & 15];
        }
    }
    wipe(&s, 0, sizeof s);
    wipe(inner, 0, sizeof inner);
    return text;
}

static PyMethodDef methods[] = {
    {"states", (PyCFunction)states, METH_O,
     "states(key_block) -> the inner and outer SHA-256 states of the HMAC key (64 bytes)"},
    {"hex32", (PyCFunction)(void (*)(void))hex32, METH_FASTCALL,
     "hex32(states, prefix, value) -> the first 32 hex digits of the HMAC-SHA256"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_identity_hmac",
    "The identity HMAC-SHA256 in C (see gateway/ratelimit/identity.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__identity_hmac(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    int sha_ni = 0;
#ifdef HAVE_SHA_NI_PATH
    /* GATEWAY_SHA_NI=0 keeps the portable block (the tests run both). */
    const char *wanted = getenv("GATEWAY_SHA_NI");
    if (has_sha_ni() && !(wanted != NULL && strcmp(wanted, "0") == 0)) {
        block_fn = compress_ni;
        sha_ni = 1;
    }
#endif
    if (PyModule_AddIntConstant(module, "SHA_NI", sha_ni) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
