/* The chain of block keys in C: the loop of kvcore/block_keys.py's block_keys for blocks without
 * extras, where Python spends ~0.6 us per block on slicing, concatenating and calling the hash.
 *
 *     chain(raw, step, parent) -> list[int]
 *
 * raw: a bytes-like object holding the blocks' token ids as u32 little-endian, block after block
 * (len(raw) a multiple of step); step: bytes per block (4 x block size, > 0); parent: the key
 * before the first block (0 <= parent < 2**64). Returns key_i = XXH3_64(u64le(key_{i-1}) +
 * raw[i*step:(i+1)*step]) for each block, key_{-1} = parent: the same keys as the Python loop
 * (xxhash's xxh3_64_intdigest, seed 0). Raises ValueError on a step < 1 or a length that is not a
 * multiple of it, OverflowError on a parent outside the u64 range.
 *
 * xxhash.h (libxxhash-dev) is included with XXH_INLINE_ALL: the hash is compiled in, nothing is
 * linked. setup.py builds this module only where the header is found; kvcore/block_keys.py falls
 * back to its Python loop without it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#if XXH_VERSION_NUMBER < 800
#error "XXH3 is stable from xxHash 0.8.0 on (python-xxhash's own); an older xxhash.h may hash otherwise"
#endif

#define STACK_BYTES 4104 /* 8 + a block of up to 1,024 tokens */

static void put_u64le(unsigned char *out, uint64_t v) {
    for (int i = 0; i < 8; i++) {
        out[i] = (unsigned char)(v >> (8 * i));
    }
}

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer raw;
    Py_ssize_t step;
    PyObject *parent_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nO", &raw, &step, &parent_obj)) {
        return NULL;
    }
    PyObject *out = NULL;
    unsigned char stack_buf[STACK_BYTES];
    unsigned char *buf = stack_buf;
    if (step < 1 || raw.len % step != 0) {
        PyErr_Format(PyExc_ValueError, "step must be >= 1 and divide the length (%zd bytes, step %zd)",
                     raw.len, step);
        goto done;
    }
    uint64_t key = PyLong_AsUnsignedLongLong(parent_obj);
    if (key == (uint64_t)-1 && PyErr_Occurred()) {
        goto done;
    }
    Py_ssize_t n = raw.len / step;
    if (n > 0 && (size_t)step + 8 > sizeof(stack_buf)) {
        buf = PyMem_Malloc((size_t)step + 8);
        if (buf == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    out = PyList_New(n);
    if (out == NULL) {
        goto done;
    }
    const unsigned char *src = raw.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        put_u64le(buf, key);
        memcpy(buf + 8, src + i * step, (size_t)step);
        key = (uint64_t)XXH3_64bits(buf, (size_t)step + 8);
        PyObject *k = PyLong_FromUnsignedLongLong(key);
        if (k == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, k);
    }
done:
    if (buf != stack_buf) {
        PyMem_Free(buf);
    }
    PyBuffer_Release(&raw);
    return out;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(raw, step, parent) -> list[int]: the block keys of raw's blocks after parent (module docstring)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_keys_native",
                                    "The chain of block keys in C (kvcore/block_keys.py).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__block_keys_native(void) { return PyModule_Create(&module); }
