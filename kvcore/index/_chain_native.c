/* The two steps of a lookup over many workers that numpy cannot make cheap, in C (optional:
 * kvcore.index.chain_rows falls back to its numpy path when this module is not built).
 *
 * probe_ids(keys, table_keys, table_ids, mul, out)
 *     The holder-set id of each block key in the host index's key table (kvcore.index.host's
 *     layout: open addressing, linear probing, home slot (key * mul mod 2**64) mod capacity, id 0
 *     an empty slot). keys: a list or tuple of ints < 2**64; table_keys: uint64 buffer of
 *     `capacity` entries; table_ids: uint32 buffer of the same length; out: writable uint32
 *     buffer of len(keys), 0 where a key is absent. Each slot is read key, id, key again, and
 *     the id taken only when both reads of the key match (the writer's protocol: a slot's id is
 *     cleared before its key changes). The home slots are prefetched a few keys ahead, so the
 *     table's cache misses overlap instead of queueing one after another.
 *
 * row_matches(rows, starts, end, names, cache, make) -> dict[str, TierMatch]
 *     kvcore.index.chain_rows.run_lengths followed by matches_from_runs, in one pass: rows is a
 *     2-D uint64 buffer (n, words), rows' words contiguous, each row the holder bits of block
 *     starts[r] (bit 4*slot + tier: 0 gpu, 1 cpu, 2 ssd, 3 speculative); starts an int64 buffer
 *     of n increasing offsets from 0; end the run's end in blocks (< 2**21). Per chain (gpu or
 *     speculative; gpu, cpu or speculative; any tier) a slot's run is starts[r] of the first row r
 *     without its bit, `end` when every row has it, 0 when row 0 lacks it. names maps slot (int)
 *     to worker id; cache maps a packed (gpu << 42 | cpu << 21 | ssd) to its TierMatch, and
 *     make(code) builds (and caches) one that is missing. Slots without a name are left out.
 *
 * runs_matches(runs, names, cache, make) -> dict[str, TierMatch]
 *     matches_from_runs alone: runs a (3, slots) int64 buffer of run lengths per chain.
 *
 * int_rows(masks, keys, hidden, rows_out, starts_out) -> (rows, end)
 *     The rows of kvcore.index.memory.MemoryIndex's wide lookup: masks maps a block key to its
 *     holder bits (a non-negative int, same layout); keys the prompt's block keys (list or tuple).
 *     From block 0, each block whose bits (less the bits of `hidden`, an int, 0 for none) differ
 *     from the block before's is one row (`hidden` no wider than a row): its bits, little-endian, in rows_out (a writable 2-D
 *     uint64 buffer of at least len(keys) contiguous rows), its block in starts_out (int64). The
 *     walk ends at the first block with no entry or no bits left (`end`, else len(keys)). Raises
 *     OverflowError when a mask does not fit a row.
 *
 * Buffers hold native little-endian integers of the size named, aligned to it (numpy arrays and
 * their views of whole items); keys are ints or objects with __index__ (numpy's integers), read
 * into a private tuple first. Errors: TypeError on arguments of the wrong type (dict subclasses
 * included), ValueError on buffers of the wrong shape, item type, alignment or length and on
 * negative runs, OverflowError on keys or masks out of range; whatever make() raises.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define LOW 0x1111111111111111ULL
#define SLOTS_PER_WORD 16
#define PREFETCH_AHEAD 16
#define RUN_LIMIT (1LL << 21)

static inline uint64_t chain_gpu(uint64_t v) { return (v | v >> 3) & LOW; }
static inline uint64_t chain_gpu_cpu(uint64_t v) { return (v | v >> 1 | v >> 3) & LOW; }
static inline uint64_t chain_any(uint64_t v) { return (v | v >> 1 | v >> 2 | v >> 3) & LOW; }

/* A buffer of little-endian (native) integers of `itemsize` bytes, aligned to them, with
   strides in whole items; -1 with ValueError (and nothing held) otherwise. */
static int
get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what)
{
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    const char *fmt = view->format ? view->format : "B";
    if (*fmt == '@' || *fmt == '=' || *fmt == '<')
        fmt++;
    const char *why = NULL;
    if (view->itemsize != itemsize)
        why = "item size";
    else if (fmt[0] == '\0' || fmt[1] != '\0' || strchr("bBhHiIlLqQnN", fmt[0]) == NULL)
        why = "item type (integers, native byte order)";
    else if ((uintptr_t)view->buf % (uintptr_t)itemsize)
        why = "alignment";
    else if (view->strides)
        for (int d = 0; d < view->ndim && !why; d++)
            if (view->strides[d] % itemsize)
                why = "strides";
    if (why) {
        PyErr_Format(PyExc_ValueError, "%s: wrong %s: expected %zd-byte integers (got format '%s', %zd bytes)",
                     what, why, itemsize, view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int
check_contiguous_1d(Py_buffer *view, Py_ssize_t itemsize, const char *what)
{
    if (view->ndim != 1 || (view->strides && view->shape[0] > 1 && view->strides[0] != itemsize)) {
        PyErr_Format(PyExc_ValueError, "%s: expected a contiguous 1-D buffer", what);
        return -1;
    }
    return 0;
}

/* ---- probe_ids ------------------------------------------------------------------------------ */

static PyObject *
probe_ids(PyObject *self, PyObject *args)
{
    PyObject *keys_obj, *tkeys_obj, *tids_obj, *out_obj;
    unsigned long long mul;
    if (!PyArg_ParseTuple(args, "OOOKO:probe_ids", &keys_obj, &tkeys_obj, &tids_obj, &mul, &out_obj))
        return NULL;
    PyObject *seq = PySequence_Tuple(keys_obj);  /* our own references: nothing can change it under us */
    if (seq == NULL)
        return NULL;
    Py_buffer tk = {0}, ti = {0}, out = {0};
    uint64_t *homes = NULL, *want = NULL;
    PyObject *result = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    if (get_buffer(tkeys_obj, &tk, 0, 8, "table_keys") < 0)
        goto done;
    if (get_buffer(tids_obj, &ti, 0, 4, "table_ids") < 0)
        goto done;
    if (get_buffer(out_obj, &out, 1, 4, "out") < 0)
        goto done;
    if (check_contiguous_1d(&tk, 8, "table_keys") < 0 || check_contiguous_1d(&ti, 4, "table_ids") < 0
        || check_contiguous_1d(&out, 4, "out") < 0)
        goto done;
    Py_ssize_t capacity = tk.shape[0];
    if (ti.shape[0] != capacity || capacity < 1) {
        PyErr_SetString(PyExc_ValueError, "probe_ids: table_keys and table_ids differ in length");
        goto done;
    }
    if (out.shape[0] != n) {
        PyErr_SetString(PyExc_ValueError, "probe_ids: out must have one entry per key");
        goto done;
    }
    homes = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    want = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (homes == NULL || want == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        unsigned long long k;
        if (PyLong_Check(item)) {
            k = PyLong_AsUnsignedLongLong(item);
        } else {  /* numpy's integers, as struct.pack takes them */
            PyObject *as_int = PyNumber_Index(item);
            if (as_int == NULL)
                goto done;
            k = PyLong_AsUnsignedLongLong(as_int);
            Py_DECREF(as_int);
        }
        if (k == (unsigned long long)-1 && PyErr_Occurred())
            goto done;
        want[i] = k;
        homes[i] = (uint64_t)(k * mul) % (uint64_t)capacity;
    }
    const uint64_t *table_keys = tk.buf;
    const uint32_t *table_ids = ti.buf;
    uint32_t *ids = out.buf;
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) {
        __builtin_prefetch(&table_keys[homes[i]]);
        __builtin_prefetch(&table_ids[homes[i]]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            __builtin_prefetch(&table_keys[homes[i + PREFETCH_AHEAD]]);
            __builtin_prefetch(&table_ids[homes[i + PREFETCH_AHEAD]]);
        }
        uint64_t p = homes[i], key = want[i];
        uint32_t found = 0;
        for (Py_ssize_t step = 0; step < capacity; step++) {
            uint64_t before = __atomic_load_n(&table_keys[p], __ATOMIC_ACQUIRE);
            uint32_t sid = __atomic_load_n(&table_ids[p], __ATOMIC_ACQUIRE);
            uint64_t after = __atomic_load_n(&table_keys[p], __ATOMIC_ACQUIRE);
            if (before == key && after == key) {
                found = sid;
                break;
            }
            if (sid == 0)
                break;
            p = p + 1 == (uint64_t)capacity ? 0 : p + 1;
        }
        ids[i] = found;
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(homes);
    PyMem_Free(want);
    if (tk.obj) PyBuffer_Release(&tk);
    if (ti.obj) PyBuffer_Release(&ti);
    if (out.obj) PyBuffer_Release(&out);
    Py_DECREF(seq);
    return result;
}

/* ---- matches -------------------------------------------------------------------------------- */

/* The result dict from per-slot runs (gpu, gpu|cpu, any), slots in increasing order. */
static PyObject *
build_matches(const int64_t *run_g, const int64_t *run_gc, const int64_t *run_a, Py_ssize_t slots,
              PyObject *names, PyObject *cache, PyObject *make)
{
    PyObject *out = PyDict_New();
    if (out == NULL)
        return NULL;
    for (Py_ssize_t s = 0; s < slots; s++) {
        int64_t a = run_a[s];
        if (a == 0)
            continue;
        int64_t g = run_g[s], gc = run_gc[s];
        if (gc < g)
            gc = g;
        if (a < 0 || a >= RUN_LIMIT || g < 0 || gc > a) {
            PyErr_Format(PyExc_ValueError, "runs of slot %zd out of range (%lld, %lld, %lld)", s,
                         (long long)g, (long long)gc, (long long)a);
            goto fail;
        }
        PyObject *slot = PyLong_FromSsize_t(s);
        if (slot == NULL)
            goto fail;
        PyObject *name = PyDict_GetItemWithError(names, slot);  /* borrowed */
        Py_DECREF(slot);
        if (name == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        Py_INCREF(name);
        PyObject *code = PyLong_FromUnsignedLongLong(
            ((unsigned long long)g << 42) | ((unsigned long long)(gc - g) << 21) | (unsigned long long)(a - gc));
        if (code == NULL) {
            Py_DECREF(name);
            goto fail;
        }
        PyObject *match = PyDict_GetItemWithError(cache, code);  /* borrowed */
        if (match != NULL) {
            Py_INCREF(match);
        } else if (!PyErr_Occurred()) {
            match = PyObject_CallOneArg(make, code);
        }
        Py_DECREF(code);
        if (match == NULL) {
            Py_DECREF(name);
            goto fail;
        }
        int rc = PyDict_SetItem(out, name, match);
        Py_DECREF(name);
        Py_DECREF(match);
        if (rc < 0)
            goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static int
check_mappings(PyObject *names, PyObject *cache, PyObject *make)
{
    if (!PyDict_CheckExact(names) || !PyDict_CheckExact(cache)) {
        PyErr_SetString(PyExc_TypeError, "names and cache must be dicts (not subclasses)");
        return -1;
    }
    if (!PyCallable_Check(make)) {
        PyErr_SetString(PyExc_TypeError, "make must be callable");
        return -1;
    }
    return 0;
}

static PyObject *
row_matches(PyObject *self, PyObject *args)
{
    PyObject *rows_obj, *starts_obj, *names, *cache, *make;
    Py_ssize_t end;
    if (!PyArg_ParseTuple(args, "OOnOOO:row_matches", &rows_obj, &starts_obj, &end, &names, &cache, &make))
        return NULL;
    if (check_mappings(names, cache, make) < 0)
        return NULL;
    Py_buffer rv = {0}, sv = {0};
    int64_t *runs = NULL;
    Py_ssize_t *active = NULL;
    uint64_t *alive = NULL;
    PyObject *result = NULL;
    if (get_buffer(rows_obj, &rv, 0, 8, "rows") < 0)
        goto done;
    if (get_buffer(starts_obj, &sv, 0, 8, "starts") < 0)
        goto done;
    if (check_contiguous_1d(&sv, 8, "starts") < 0)
        goto done;
    if (rv.ndim != 2 || (rv.strides && rv.shape[1] > 1 && rv.strides[1] != 8) || rv.shape[0] < 1) {
        PyErr_SetString(PyExc_ValueError, "rows: expected a 2-D buffer of at least one row, words contiguous");
        goto done;
    }
    Py_ssize_t n = rv.shape[0], words = rv.shape[1];
    Py_ssize_t row_stride = (rv.strides ? rv.strides[0] : words * 8) / 8;
    if (sv.shape[0] < n) {
        PyErr_SetString(PyExc_ValueError, "starts: one offset per row");
        goto done;
    }
    if (end < 0 || end >= RUN_LIMIT) {
        PyErr_SetString(PyExc_ValueError, "end out of range");
        goto done;
    }
    const uint64_t *rows = rv.buf;
    const int64_t *starts = sv.buf;
    Py_ssize_t slots = words * SLOTS_PER_WORD;
    runs = PyMem_Calloc((size_t)(3 * slots + 1), sizeof(int64_t));
    active = PyMem_Malloc((size_t)(words + 1) * sizeof(Py_ssize_t));
    alive = PyMem_Malloc((size_t)(3 * words + 1) * sizeof(uint64_t));
    if (runs == NULL || active == NULL || alive == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *run[3] = {runs, runs + slots, runs + 2 * slots};
    Py_ssize_t n_active = 0;
    for (Py_ssize_t w = 0; w < words; w++) {
        uint64_t v = rows[w];
        alive[3 * w] = chain_gpu(v);
        alive[3 * w + 1] = chain_gpu_cpu(v);
        alive[3 * w + 2] = chain_any(v);
        if (alive[3 * w + 2])
            active[n_active++] = w;
    }
    /* row by row over the words that still have a running slot; a word leaves the list when
       its last run ends (chains only lose bits, and gpu and gpu|cpu are subsets of any). A
       word equal to the row before's changes nothing: only the alive bits of its last
       different row matter, and those were applied then */
    for (Py_ssize_t r = 1; r < n && n_active; r++) {
        const uint64_t *row = rows + r * row_stride, *prev = row - row_stride;
        int64_t at = starts[r];
        Py_ssize_t kept = 0;
        for (Py_ssize_t j = 0; j < n_active; j++) {
            Py_ssize_t w = active[j];
            uint64_t v = row[w];
            if (v == prev[w]) {  /* the same holders in this word: no run ends here (most words) */
                active[kept++] = w;
                continue;
            }
            uint64_t now[3] = {chain_gpu(v), chain_gpu_cpu(v), chain_any(v)};
            for (int c = 0; c < 3; c++) {
                uint64_t dropped = alive[3 * w + c] & ~now[c];
                while (dropped) {
                    run[c][w * SLOTS_PER_WORD + (__builtin_ctzll(dropped) >> 2)] = at;
                    dropped &= dropped - 1;
                }
                alive[3 * w + c] &= now[c];
            }
            if (alive[3 * w + 2])
                active[kept++] = w;
        }
        n_active = kept;
    }
    for (Py_ssize_t j = 0; j < n_active; j++) {
        Py_ssize_t w = active[j];
        for (int c = 0; c < 3; c++) {
            uint64_t left = alive[3 * w + c];
            while (left) {
                run[c][w * SLOTS_PER_WORD + (__builtin_ctzll(left) >> 2)] = end;
                left &= left - 1;
            }
        }
    }
    result = build_matches(run[0], run[1], run[2], slots, names, cache, make);
done:
    PyMem_Free(runs);
    PyMem_Free(active);
    PyMem_Free(alive);
    if (rv.obj) PyBuffer_Release(&rv);
    if (sv.obj) PyBuffer_Release(&sv);
    return result;
}

static PyObject *
runs_matches(PyObject *self, PyObject *args)
{
    PyObject *runs_obj, *names, *cache, *make;
    if (!PyArg_ParseTuple(args, "OOOO:runs_matches", &runs_obj, &names, &cache, &make))
        return NULL;
    if (check_mappings(names, cache, make) < 0)
        return NULL;
    Py_buffer view = {0};
    if (get_buffer(runs_obj, &view, 0, 8, "runs") < 0)
        return NULL;
    PyObject *result = NULL;
    if (view.ndim != 2 || view.shape[0] != 3 || (view.strides && view.strides[1] != 8)) {
        PyErr_SetString(PyExc_ValueError, "runs: expected a (3, slots) int64 buffer, slots contiguous");
    } else {
        Py_ssize_t row = (view.strides ? view.strides[0] : view.shape[1] * 8) / 8;
        const int64_t *runs = view.buf;
        result = build_matches(runs, runs + row, runs + 2 * row, view.shape[1], names, cache, make);
    }
    PyBuffer_Release(&view);
    return result;
}

/* ---- int_rows ------------------------------------------------------------------------------ */

/* The digits of int `v` (PyLong_SHIFT bits each, least significant first) where this CPython's
   layout is known (3.11: ob_digit and the sign in Py_SIZE; 3.12-3.14: long_value, the digit
   count and sign in lv_tag, Include/cpython/longintrepr.h); *ndigits < 0 for a negative int. */
#if PY_VERSION_HEX < 0x030C0000
#define DIGITS_OF_INTS 1
static inline const digit *
int_digits(PyObject *v, Py_ssize_t *ndigits)
{
    *ndigits = Py_SIZE(v);
    return ((PyLongObject *)v)->ob_digit;
}
#elif PY_VERSION_HEX < 0x030F0000
#define DIGITS_OF_INTS 1
static inline const digit *
int_digits(PyObject *v, Py_ssize_t *ndigits)
{
    uintptr_t tag = ((PyLongObject *)v)->long_value.lv_tag;
    *ndigits = (tag & 3) == 2 ? -1 : (Py_ssize_t)(tag >> 3);
    return ((PyLongObject *)v)->long_value.ob_digit;
}
#endif

/* `v` (a non-negative int) as `n` little-endian bytes (`n` a multiple of 8, `out` aligned to
   8); -1 with OverflowError when it needs more or is negative. Where the digit layout is known
   the digits are packed into 64-bit words directly (CPython's byte-array conversion goes a byte
   at a time); elsewhere through CPython's conversion. */
static int
int_to_row(PyObject *v, unsigned char *out, size_t n)
{
    if (!PyLong_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "int_rows: masks must hold ints");
        return -1;
    }
#ifdef DIGITS_OF_INTS
    Py_ssize_t nd;
    const digit *d = int_digits(v, &nd);
    if (nd < 0) {
        PyErr_SetString(PyExc_OverflowError, "int_rows: a mask is negative");
        return -1;
    }
    if (nd > 0) {  /* the top digit is non-zero: the int's bit length from it */
        size_t top_bits = 0;
        for (digit t = d[nd - 1]; t; t >>= 1)
            top_bits++;
        if ((size_t)(nd - 1) * PyLong_SHIFT + top_bits > n * 8) {
            PyErr_SetString(PyExc_OverflowError, "int_rows: a mask is wider than a row");
            return -1;
        }
    }
    uint64_t *words = (uint64_t *)out;
    size_t n_words = n / 8, w = 0;
    uint64_t acc = 0;
    unsigned fill = 0;  /* bits of acc in use */
    for (Py_ssize_t i = 0; i < nd; i++) {
        uint64_t dv = d[i];
        acc |= dv << fill;
        fill += PyLong_SHIFT;
        if (fill >= 64) {
            words[w++] = acc;
            fill -= 64;
            acc = fill ? dv >> (PyLong_SHIFT - fill) : 0;
        }
    }
    if (w < n_words)
        words[w++] = acc;
    if (w < n_words)
        memset(words + w, 0, (n_words - w) * 8);
    return 0;
#elif PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t need = PyLong_AsNativeBytes(v, out, (Py_ssize_t)n, Py_ASNATIVEBYTES_LITTLE_ENDIAN
                                           | Py_ASNATIVEBYTES_UNSIGNED_BUFFER | Py_ASNATIVEBYTES_REJECT_NEGATIVE);
    if (need < 0)
        return -1;
    if ((size_t)need > n) {
        PyErr_SetString(PyExc_OverflowError, "int_rows: a mask is wider than a row");
        return -1;
    }
    return 0;
#else
    return _PyLong_AsByteArray((PyLongObject *)v, out, n, 1, 0);
#endif
}

static PyObject *
int_rows(PyObject *self, PyObject *args)
{
    PyObject *masks, *keys_obj, *hidden, *rows_obj, *starts_obj;
    if (!PyArg_ParseTuple(args, "OOOOO:int_rows", &masks, &keys_obj, &hidden, &rows_obj, &starts_obj))
        return NULL;
    if (!PyDict_CheckExact(masks)) {
        PyErr_SetString(PyExc_TypeError, "int_rows: masks must be a dict");
        return NULL;
    }
    if (!PyLong_Check(hidden)) {
        PyErr_SetString(PyExc_TypeError, "int_rows: hidden must be an int");
        return NULL;
    }
    PyObject *seq = PySequence_Tuple(keys_obj);  /* our own references: a key's __hash__ cannot pull them away */
    if (seq == NULL)
        return NULL;
    PyObject *prev = NULL;  /* a strong reference: compared by identity */
    Py_buffer rv = {0}, sv = {0};
    uint64_t *keep = NULL;
    PyObject *result = NULL;
    Py_ssize_t n_keys = PyTuple_GET_SIZE(seq);
    if (get_buffer(rows_obj, &rv, 1, 8, "rows_out") < 0 || get_buffer(starts_obj, &sv, 1, 8, "starts_out") < 0)
        goto done;
    if (check_contiguous_1d(&sv, 8, "starts_out") < 0)
        goto done;
    if (rv.ndim != 2 || (rv.strides && (rv.strides[1] != 8 || rv.strides[0] != rv.shape[1] * 8))) {
        PyErr_SetString(PyExc_ValueError, "rows_out: expected a C-contiguous 2-D buffer");
        goto done;
    }
    if (rv.shape[0] < n_keys || sv.shape[0] < n_keys) {
        PyErr_SetString(PyExc_ValueError, "rows_out and starts_out need one entry per key");
        goto done;
    }
    Py_ssize_t words = rv.shape[1];
    size_t row_bytes = (size_t)words * 8;
    int masked = PyObject_IsTrue(hidden);
    if (masked < 0)
        goto done;
    if (masked) {
        keep = PyMem_Malloc(row_bytes ? row_bytes : 8);
        if (keep == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        if (int_to_row(hidden, (unsigned char *)keep, row_bytes) < 0)  /* callers cut it to a row */
            goto done;
        for (Py_ssize_t w = 0; w < words; w++)
            keep[w] = ~keep[w];
    }
    uint64_t *rows = rv.buf;
    int64_t *starts = sv.buf;
    Py_ssize_t n = 0, end = n_keys;
    for (Py_ssize_t i = 0; i < n_keys; i++) {
        PyObject *v = PyDict_GetItemWithError(masks, PyTuple_GET_ITEM(seq, i));  /* borrowed */
        if (v == NULL) {
            if (PyErr_Occurred())
                goto done;
            end = i;
            break;
        }
        if (v == prev)  /* the same int object: the same holders */
            continue;
        Py_INCREF(v);
        Py_XSETREF(prev, v);
        uint64_t *row = rows + n * words;
        if (int_to_row(v, (unsigned char *)row, row_bytes) < 0)
            goto done;
        uint64_t any = 0;
        for (Py_ssize_t w = 0; w < words; w++) {
            if (masked)
                row[w] &= keep[w];
            any |= row[w];
        }
        if (!any) {
            end = i;
            break;
        }
        if (n && memcmp(row, row - words, row_bytes) == 0)
            continue;
        starts[n++] = i;
    }
    result = Py_BuildValue("nn", n, n ? end : 0);
done:
    Py_XDECREF(prev);
    PyMem_Free(keep);
    if (rv.obj) PyBuffer_Release(&rv);
    if (sv.obj) PyBuffer_Release(&sv);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"probe_ids", probe_ids, METH_VARARGS, "Holder-set ids of block keys in the host index's key table."},
    {"row_matches", row_matches, METH_VARARGS, "Per-worker TierMatch from holder rows."},
    {"runs_matches", runs_matches, METH_VARARGS, "Per-worker TierMatch from run lengths."},
    {"int_rows", int_rows, METH_VARARGS, "Holder rows of a prompt from an int-mask dict."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chain_native",
    "Native steps of kvcore.index lookups over many workers (see the C source's header).", -1, methods,
};

PyMODINIT_FUNC
PyInit__chain_native(void)
{
    return PyModule_Create(&module);
}
