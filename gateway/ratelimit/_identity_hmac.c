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
 * Nothing here keeps anything between calls; no allocation but the result.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 64
#define HEX_CHARS 32

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

/* One 64-byte block into the state (FIPS 180-4, 6.2.2). */
static void compress(uint32_t state[8], const unsigned char block[BLOCK]) {
    uint32_t w[64];
    for (int t = 0; t < 16; t++) {
        w[t] = load_be32(block + 4 * t);
    }
    for (int t = 16; t < 64; t++) {
        uint32_t s0 = ROTR(w[t - 15], 7) ^ ROTR(w[t - 15], 18) ^ (w[t - 15] >> 3);
        uint32_t s1 = ROTR(w[t - 2], 17) ^ ROTR(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int t = 0; t < 64; t++) {
        uint32_t t1 = h + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) +
                      K[t] + w[t];
        uint32_t t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
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
        compress(s->state, s->buf);
        s->done += BLOCK;
        s->used = 0;
    }
    while (size >= BLOCK) {
        compress(s->state, data);
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
        compress(s->state, s->buf);
        s->used = 0;
    }
    memset(s->buf + s->used, 0, BLOCK - 8 - s->used);
    for (int i = 0; i < 8; i++) {
        s->buf[BLOCK - 1 - i] = (unsigned char)(bits >> (8 * i));
    }
    compress(s->state, s->buf);
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
    }
    PyObject *result = PyBytes_FromStringAndSize((const char *)out, sizeof out);
    /* Key material off the stack. */
    memset(pad, 0, sizeof pad);
    memset(out, 0, sizeof out);
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
    memset(&s, 0, sizeof s);
    memset(inner, 0, sizeof inner);
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

PyMODINIT_FUNC PyInit__identity_hmac(void) { return PyModule_Create(&module_def); }
