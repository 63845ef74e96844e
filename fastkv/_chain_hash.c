/*
 * Chained SHA-256 over full blocks of token ids, the hot loop of fastkv.hashing.
 *
 * digest[i] = SHA256(digest[i-1] || le_u32(tokens of block i) [|| extra_i || le_u32(len(extra_i))])
 * with digest[-1] = parent. fastkv/hashing.py holds the reference implementation in
 * pure Python; both must give identical bytes (tests/test_hashing.py checks it).
 * The loop lives in C because per-block interpreter overhead would otherwise cost
 * more than SHA-256 itself at small block sizes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
/* The low-level SHA256_* calls cost ~20 ns per block; EVP_DigestInit_ex costs
 * ~400 ns in OpenSSL 3 (provider dispatch), more than hashing a 64-token block. */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#define DIGEST_BYTES 32

/* Reads token `i` from a buffer of itemsize 4 or 8 (signed or not) or from a
 * PySequence_Fast item array. Returns 0 and sets *out, or -1 with a Python error. */
typedef struct {
  const Py_buffer *buf; /* NULL when reading a sequence */
  int is_signed;
  int big_endian; /* the buffer's byte order */
  int native;     /* the buffer is in the machine's order: typed loads */
  PyObject **items;
} token_source;

static uint64_t load_bytes(const unsigned char *p, Py_ssize_t n, int big_endian) {
  uint64_t x = 0;
  for (Py_ssize_t k = 0; k < n; k++) {
    x |= (uint64_t)p[big_endian ? n - 1 - k : k] << (8 * k);
  }
  return x;
}

/* The zero-extended item at p. Native order (every array hashing.py passes) is
 * one typed load; the byte loop serves only buffers in the other order. */
static uint64_t load_item(const unsigned char *p, Py_ssize_t n, const token_source *src) {
  if (!src->native) return load_bytes(p, n, src->big_endian);
  switch (n) {
    case 8: {
      uint64_t x;
      memcpy(&x, p, 8);
      return x;
    }
    case 4: {
      uint32_t x;
      memcpy(&x, p, 4);
      return x;
    }
    case 2: {
      uint16_t x;
      memcpy(&x, p, 2);
      return x;
    }
    default:
      return *p;
  }
}

static int read_token(const token_source *src, Py_ssize_t i, uint32_t *out) {
  long long v;
  if (src->buf != NULL) {
    const Py_ssize_t n = src->buf->itemsize;
    const unsigned char *p = (const unsigned char *)src->buf->buf + i * n;
    const uint64_t raw = load_item(p, n, src);
    if (src->is_signed) {
      const int shift = 64 - 8 * (int)n; /* sign-extend from n bytes */
      v = (long long)((int64_t)(raw << shift) >> shift);
    } else {
      if (raw > UINT32_MAX) goto range_error;
      *out = (uint32_t)raw;
      return 0;
    }
  } else {
    PyObject *item = src->items[i];
#if PY_VERSION_HEX < 0x030C0000
    /* CPython 3.11 ints: a size-1 exact int is one 30-bit digit. Reading it
     * directly halves the cost of hashing a list of token ids. */
    if (PyLong_CheckExact(item) && Py_SIZE(item) == 1) {
      *out = (uint32_t)((PyLongObject *)item)->ob_digit[0];
      return 0;
    }
#endif
    if (PyBool_Check(item)) {
      PyErr_Format(PyExc_TypeError, "tokens: position %zd: booleans are not token ids", i);
      return -1;
    }
    int overflow = 0;
    v = PyLong_AsLongLongAndOverflow(item, &overflow); /* any __index__ */
    if (v == -1 && PyErr_Occurred()) {
      if (PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Format(PyExc_TypeError, "tokens: position %zd: expected an int, got %s", i,
                     Py_TYPE(item)->tp_name);
      }
      return -1;
    }
    if (overflow) goto range_error;
  }
  if (v < 0 || v > (long long)UINT32_MAX) goto range_error;
  *out = (uint32_t)v;
  return 0;
range_error:
  PyErr_Format(PyExc_ValueError, "tokens: token id at position %zd is outside [0, 2**32)", i);
  return -1;
}

static int open_tokens(PyObject *tokens, Py_buffer *view, token_source *src,
                       PyObject **fast, Py_ssize_t *count) {
  src->buf = NULL;
  src->is_signed = 0;
  src->big_endian = 0;
  src->native = 1;
  src->items = NULL;
  *fast = NULL;
  if (PyBytes_Check(tokens) || PyByteArray_Check(tokens) || PyUnicode_Check(tokens)) {
    PyErr_Format(PyExc_TypeError, "tokens: expected integer token ids, got %s (text, not ids)",
                 Py_TYPE(tokens)->tp_name);
    return -1;
  }
  if (PyObject_CheckBuffer(tokens) &&
      PyObject_GetBuffer(tokens, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
    const char *fmt = view->format ? view->format : "B";
    const int machine_big_endian = (*(const uint16_t *)"\x01\x00") != 1;
    src->big_endian = machine_big_endian;
    if (*fmt == '>' || *fmt == '!' || *fmt == '<') {
      src->big_endian = *fmt != '<';
      fmt++;
    } else if (*fmt == '=' || *fmt == '@') {
      fmt++;
    }
    src->native = src->big_endian == machine_big_endian;
    int ok = fmt[0] != '\0' && fmt[1] == '\0' && strchr("bBhHiIlLqQ", fmt[0]) != NULL &&
             (view->itemsize == 1 || view->itemsize == 2 || view->itemsize == 4 ||
              view->itemsize == 8);
    if (!ok || view->ndim > 1) {
      PyErr_Format(PyExc_TypeError, "tokens: expected a 1-D integer array, got format '%s'",
                   view->format ? view->format : "B");
      PyBuffer_Release(view);
      return -1;
    }
    src->buf = view;
    src->is_signed = strchr("bhilq", fmt[0]) != NULL;
    *count = view->len / view->itemsize;
    return 0;
  }
  PyErr_Clear();
  *fast = PySequence_Fast(tokens, "tokens: expected a sequence of ints or an integer buffer");
  if (*fast == NULL) return -1;
  src->items = PySequence_Fast_ITEMS(*fast);
  *count = PySequence_Fast_GET_SIZE(*fast);
  return 0;
}

static PyObject *chain(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer parent;
  PyObject *tokens, *extras;
  Py_ssize_t block_size, num_blocks;
  if (!PyArg_ParseTuple(args, "y*OnnO", &parent, &tokens, &block_size, &num_blocks, &extras))
    return NULL;

  PyObject *result = NULL, *fast = NULL;
  Py_buffer view;
  int have_view = 0;
  uint32_t *words = NULL;
  SHA256_CTX ctx;
  token_source src;
  Py_ssize_t count;

  if (parent.len != DIGEST_BYTES) {
    PyErr_Format(PyExc_ValueError, "parent: must be %d bytes, got %zd", DIGEST_BYTES, parent.len);
    goto done;
  }
  if (block_size <= 0) {
    PyErr_SetString(PyExc_ValueError, "block_size: must be positive");
    goto done;
  }
  if (num_blocks < 0) {
    PyErr_SetString(PyExc_ValueError, "num_blocks: must be >= 0");
    goto done;
  }
  if (extras != Py_None && (!PyList_Check(extras) || PyList_GET_SIZE(extras) != num_blocks)) {
    PyErr_SetString(PyExc_ValueError, "extras: must be None or a list with one entry per block");
    goto done;
  }
  if (open_tokens(tokens, &view, &src, &fast, &count) < 0) goto done;
  have_view = src.buf != NULL;
  if (num_blocks > count / block_size) {
    PyErr_SetString(PyExc_ValueError, "num_blocks: more blocks than full blocks of tokens");
    goto done;
  }

  words = PyMem_Malloc((size_t)block_size * sizeof(uint32_t));
  result = PyList_New(num_blocks);
  if (words == NULL || result == NULL) {
    if (!PyErr_Occurred()) PyErr_NoMemory();
    Py_CLEAR(result);
    goto done;
  }
  unsigned char digest[DIGEST_BYTES];
  memcpy(digest, parent.buf, DIGEST_BYTES);
  const int little = (*(const uint16_t *)"\x01\x00") == 1;

  for (Py_ssize_t b = 0; b < num_blocks; b++) {
    const Py_ssize_t base = b * block_size;
    if (src.buf != NULL && src.buf->itemsize == 4 && !src.is_signed && !src.big_endian && little) {
      memcpy(words, (const char *)src.buf->buf + base * 4, (size_t)block_size * 4);
    } else if (src.buf != NULL && src.buf->itemsize == 8 && src.native) {
      /* numpy's default int64: one load and one compare per token (a negative
       * id reads as a huge unsigned one); read_token words the error. */
      const unsigned char *p = (const unsigned char *)src.buf->buf + base * 8;
      for (Py_ssize_t t = 0; t < block_size; t++) {
        uint64_t x;
        memcpy(&x, p + t * 8, 8);
        if (x > UINT32_MAX) {
          uint32_t w;
          if (read_token(&src, base + t, &w) < 0) {
            Py_CLEAR(result);
            goto done;
          }
          x = w;
        }
        words[t] = little ? (uint32_t)x : __builtin_bswap32((uint32_t)x);
      }
    } else {
      for (Py_ssize_t t = 0; t < block_size; t++) {
        uint32_t w;
        if (read_token(&src, base + t, &w) < 0) {
          Py_CLEAR(result);
          goto done;
        }
        words[t] = little ? w : __builtin_bswap32(w);
      }
    }
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, digest, DIGEST_BYTES);
    SHA256_Update(&ctx, words, (size_t)block_size * 4);
    if (extras != Py_None) {
      PyObject *extra = PyList_GET_ITEM(extras, b);
      if (extra != Py_None) {
        if (!PyBytes_Check(extra)) {
          PyErr_Format(PyExc_TypeError, "extras: entry %zd must be bytes or None", b);
          Py_CLEAR(result);
          goto done;
        }
        const uint32_t n = (uint32_t)PyBytes_GET_SIZE(extra);
        const unsigned char len_le[4] = {n & 0xff, (n >> 8) & 0xff, (n >> 16) & 0xff, n >> 24};
        SHA256_Update(&ctx, PyBytes_AS_STRING(extra), n);
        SHA256_Update(&ctx, len_le, 4);
      }
    }
    SHA256_Final(digest, &ctx);
    PyObject *item = PyBytes_FromStringAndSize((const char *)digest, DIGEST_BYTES);
    if (item == NULL) {
      Py_CLEAR(result);
      goto done;
    }
    PyList_SET_ITEM(result, b, item);
  }
  /* The partial tail is not hashed, but it is part of the input: check it too. */
  for (Py_ssize_t t = num_blocks * block_size; t < count; t++) {
    uint32_t w;
    if (read_token(&src, t, &w) < 0) {
      Py_CLEAR(result);
      goto done;
    }
  }

done:
  PyMem_Free(words);
  if (have_view) PyBuffer_Release(&view);
  Py_XDECREF(fast);
  PyBuffer_Release(&parent);
  return result;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(parent, tokens, block_size, num_blocks, extras) -> list[bytes]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain_hash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain_hash(void) { return PyModule_Create(&module); }
