/* gds_kv_connector._native: the per-block loops of the executor and transfer threads, in C.
 *
 * Python costs about a microsecond per block for each of these loops, and on a 256 KiB block
 * the whole DMA takes 4.8 us at PCIe speed, so the loops, not the copies, would bound small
 * blocks.  Each function does one batch: it reads its arguments while holding the
 * GIL, releases it for the loop, and returns plain values.  Byte layouts are the ones in
 * docs/format.md and format/records.py; the tests check every function against the Python code.
 *
 * It also holds the slab guard (guard, unguard, guard_lost, arm_guard), which keeps a truncated
 * arena slab from killing the process with SIGBUS; that one has no Python twin.
 *
 * Built against the stable ABI (abi3, Python >= 3.11) and OpenSSL's SHA-256 (libcrypto); optional:
 * gds_kv_connector.native falls back to the Python code where it was not built.
 */
#define Py_LIMITED_API 0x030B0000 /* Py_buffer joined the stable ABI in 3.11 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED /* SHA256_Init/Update/Final: no context allocation per block */
#include <Python.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <stdlib.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define KEY 32
#define HEADER_SIZE 4096
#define FIELDS 156   /* header bytes up to and including the CRC */
#define CRC_AT 152
#define MAX_PAYLOAD (1ULL << 32)

/* CRC-32 (zlib's: reflected 0xEDB88320), the header checksum; 152 bytes a call, so a table is plenty. */
static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int j = 0; j < 8; j++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

static uint32_t crc32(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n--) crc = crc_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

static const unsigned char MAGIC[8] = {'G', 'D', 'S', 'K', 'V', 'B', 'L', 'K'};

static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); } /* x86-64 and arm64: little-endian */
static void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* Which loops release the GIL.  Releasing is a hand-off point: another thread takes the GIL and
 * this one then queues until that thread blocks again, so a short loop on the executor thread is
 * better off keeping it: chain_keys (the scheduler's match) keeps it under RELEASE_MIN_BLOCKS blocks
 * (about 0.3 us a block; kept, a 4-block chain's p99 behind two busy threads is about 2 us, against
 * 80-90 us with the release).  The slot-header loops run
 * on transfer threads, where no executor latency is at stake, so they always release it and the
 * other transfer threads run their Python meanwhile.  Keeping it there under 64 / 512 slots
 * showed no gain in 256 KiB host-memory arena saves (within the bench's spread either way).
 * link_keys (system calls) always releases. */
#define RELEASE_MIN_BLOCKS 64
/* From this many blocks chain_keys hashes on a second thread while it converts the tokens (see
 * chain_job), publishing every CHAIN_PUBLISH_BLOCKS blocks. */
#define CHAIN_PIPELINE_BLOCKS 512
#define CHAIN_PUBLISH_BLOCKS 16

static PyThreadState *release_gil_if(int worth_it) { return worth_it ? PyEval_SaveThread() : NULL; }

static void take_gil_back(PyThreadState *saved) {
    if (saved) PyEval_RestoreThread(saved);
}

/* A read-only contiguous buffer of exactly `want` bytes (want < 0: any length). */
static int get_buf(PyObject *obj, Py_buffer *view, Py_ssize_t want, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) return -1;
    if (want >= 0 && view->len != want) {
        PyErr_Format(PyExc_ValueError, "%s is %zd bytes, expected %zd", what, view->len, want);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* An array of slot addresses (native uint64): its buffer and entry count in *n. */
static int get_addrs(PyObject *obj, Py_buffer *view, Py_ssize_t *n) {
    if (get_buf(obj, view, -1, "addrs") < 0) return -1;
    if (view->len % 8) {
        PyErr_SetString(PyExc_ValueError, "addrs is not a uint64 array");
        PyBuffer_Release(view);
        return -1;
    }
    *n = view->len / 8;
    return 0;
}

/* The i-th address of such an array, as a pointer. */
static unsigned char *addr_at(const Py_buffer *addrs, Py_ssize_t i) {
    return (unsigned char *)(uintptr_t)get64((const unsigned char *)addrs->buf + i * 8);
}

/* chain_keys(prev, tokens, start, tokens_per_block, n) -> list of n keys
 *
 * key[i] = SHA-256(key[i-1] || tokens[start + i*tpb : start + (i+1)*tpb] as little-endian int64),
 * key[-1] = prev: keys.extend_chain over keys.token_array, without the int64 array or a Python
 * call per block.  tokens is a list or tuple of ints. */
/* The hashing half of a long chain_keys: key b hashes key b-1 and block b's tokens once the executor
 * thread, which converts the tokens (it must hold the GIL to read the ints), has published block b
 * through `ready`.  So the two halves overlap: the conversion and the hashing of a 128k-token prompt take
 * about the same time (a few milliseconds together). */
struct chain_job {
    const unsigned char *prev;
    const int64_t *toks;
    unsigned char *keys;
    size_t width;
    Py_ssize_t n;
    atomic_long ready;  /* blocks whose tokens are converted */
    atomic_int abort;   /* the conversion failed: stop */
    atomic_long hashed; /* blocks whose keys are written (chain_present's stat threads follow it) */
};

static void hash_blocks(const unsigned char *prev, const int64_t *toks, unsigned char *keys, size_t width,
                        Py_ssize_t from, Py_ssize_t to) {
    const unsigned char *p = from ? keys + (from - 1) * KEY : prev;
    for (Py_ssize_t b = from; b < to; b++) {
        SHA256_CTX c;
        SHA256_Init(&c);
        SHA256_Update(&c, p, KEY);
        SHA256_Update(&c, (const unsigned char *)toks + b * width, width);
        SHA256_Final(keys + b * KEY, &c);
        p = keys + b * KEY;
    }
}

static void *chain_job_run(void *arg) {
    struct chain_job *j = arg;
    Py_ssize_t done = 0;
    while (done < j->n) {
        Py_ssize_t ready = atomic_load_explicit(&j->ready, memory_order_acquire);
        if (ready == done) {
            if (atomic_load_explicit(&j->abort, memory_order_relaxed)) break;
            sched_yield();
            continue;
        }
        hash_blocks(j->prev, j->toks, j->keys, j->width, done, ready);
        done = ready;
        atomic_store_explicit(&j->hashed, (long)done, memory_order_release);
    }
    return NULL;
}

/* Checks chain_keys' arguments: 0 and *is_list set, or -1 with the error set. */
static int chain_check(PyObject *tokens, Py_ssize_t start, Py_ssize_t tpb, Py_ssize_t n, int *is_list) {
    *is_list = PyList_Check(tokens);
    if (!*is_list && !PyTuple_Check(tokens)) {
        PyErr_SetString(PyExc_TypeError, "tokens must be a list or tuple of ints");
        return -1;
    }
    if (tpb <= 0 || n < 0 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "tokens_per_block must be positive, start and n not negative");
        return -1;
    }
    Py_ssize_t have = *is_list ? PyList_Size(tokens) : PyTuple_Size(tokens);
    if (n > (PY_SSIZE_T_MAX / 8 - start) / tpb || start + n * tpb > have) {
        PyErr_Format(PyExc_ValueError, "%zd blocks of %zd tokens from token %zd need more than the %zd tokens given",
                     n, tpb, start, have);
        return -1;
    }
    return 0;
}

/* Converts the tokens of n blocks from tokens[start] into toks (the GIL held: reading an int needs
 * it); with a job, whose hasher runs on another thread, publishes each CHAIN_PUBLISH_BLOCKS blocks
 * to it, or aborts it on failure.  -1 with the error set where a token is not an int64. */
static int convert_tokens(PyObject *tokens, int is_list, Py_ssize_t start, Py_ssize_t tpb, Py_ssize_t n,
                          int64_t *toks, struct chain_job *job) {
    for (Py_ssize_t b = 0, i = 0; b < n; b++) {
        for (Py_ssize_t end = i + tpb; i < end; i++) {
            PyObject *t = is_list ? PyList_GetItem(tokens, start + i) : PyTuple_GetItem(tokens, start + i);
            long long v = -1;
            if (t && PyLong_CheckExact(t)) {
                v = PyLong_AsLongLong(t);
            } else if (t) {
                /* An int subclass's __index__ runs Python code, which may shrink the list and free t:
                 * t is held for the call, and a shrunk list is an IndexError, not a SystemError. */
                Py_INCREF(t);
                v = PyLong_AsLongLong(t);
                Py_DECREF(t);
            }
            if (!t || (v == -1 && PyErr_Occurred())) {
                if (job) atomic_store_explicit(&job->abort, 1, memory_order_relaxed);
                return -1;
            }
            toks[i] = (int64_t)v;
        }
        if (job && (b % CHAIN_PUBLISH_BLOCKS == CHAIN_PUBLISH_BLOCKS - 1 || b == n - 1))
            atomic_store_explicit(&job->ready, (long)(b + 1), memory_order_release);
    }
    return 0;
}

/* n keys of KEY bytes as a list of bytes. */
static PyObject *key_list(const unsigned char *keys, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    for (Py_ssize_t b = 0; out && b < n; b++) {
        PyObject *k = PyBytes_FromStringAndSize((const char *)keys + b * KEY, KEY);
        if (!k) Py_CLEAR(out);
        else PyList_SetItem(out, b, k);
    }
    return out;
}

static PyObject *chain_keys(PyObject *self, PyObject *args) {
    PyObject *prev_obj, *tokens;
    Py_ssize_t start, tpb, n;
    int is_list;
    if (!PyArg_ParseTuple(args, "OOnnn", &prev_obj, &tokens, &start, &tpb, &n)) return NULL;
    if (chain_check(tokens, start, tpb, n, &is_list) < 0) return NULL;
    Py_buffer prev;
    if (get_buf(prev_obj, &prev, KEY, "prev key") < 0) return NULL;
    int64_t *toks = malloc((size_t)(n && tpb ? n * tpb : 1) * 8);
    unsigned char *keys = malloc((size_t)(n ? n : 1) * KEY);
    PyObject *out = NULL;
    if (!toks || !keys) {
        PyErr_NoMemory();
        goto done;
    }
    size_t width = (size_t)tpb * 8;
    struct chain_job job = {prev.buf, toks, keys, width, n, 0, 0, 0};
    pthread_t hasher;
    int pipelined = n >= CHAIN_PIPELINE_BLOCKS && pthread_create(&hasher, NULL, chain_job_run, &job) == 0;
    int failed = convert_tokens(tokens, is_list, start, tpb, n, toks, pipelined ? &job : NULL) < 0;
    if (pipelined) {
        Py_BEGIN_ALLOW_THREADS
        pthread_join(hasher, NULL);
        Py_END_ALLOW_THREADS
    }
    if (failed) goto done;
    if (!pipelined) {
        PyThreadState *saved = release_gil_if(n >= RELEASE_MIN_BLOCKS);
        hash_blocks(prev.buf, toks, keys, width, 0, n);
        take_gil_back(saved);
    }
    out = key_list(keys, n);
done:
    free(toks);
    free(keys);
    PyBuffer_Release(&prev);
    return out;
}

/* write_headers(addrs, fingerprint, keys, parents, sums, payload_len, algo, tokens_per_block, created_ns)
 *
 * Writes the 156 field bytes of a version-1 block header (pool_format.BlockHeader.pack_fields) at
 * each address: addrs, sums are native uint64 arrays of n entries, keys and parents n*32 bytes.
 * The addresses are slot starts inside the caller's writable slab mappings. */
static PyObject *write_headers(PyObject *self, PyObject *args) {
    PyObject *ao, *fo, *ko, *po, *so;
    unsigned long long plen, created;
    unsigned int algo, tpb;
    if (!PyArg_ParseTuple(args, "OOOOOKIIK", &ao, &fo, &ko, &po, &so, &plen, &algo, &tpb, &created)) return NULL;
    Py_buffer a, f, k, p, s;
    Py_ssize_t n;
    if (get_addrs(ao, &a, &n) < 0) return NULL;
    if (get_buf(fo, &f, KEY, "fingerprint") < 0) goto e0;
    if (get_buf(ko, &k, n * KEY, "keys") < 0) goto e1;
    if (get_buf(po, &p, n * KEY, "parents") < 0) goto e2;
    if (get_buf(so, &s, n * 8, "sums") < 0) goto e3;
    PyThreadState *saved = PyEval_SaveThread();
    unsigned char h[FIELDS];
    memset(h, 0, sizeof h);
    memcpy(h, MAGIC, 8);
    put32(h + 8, 1);
    put32(h + 12, HEADER_SIZE);
    memcpy(h + 16, f.buf, KEY);
    put64(h + 80, plen);
    put32(h + 96, algo);
    put32(h + 100, tpb);
    put64(h + 104, created);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(h + 48, (const unsigned char *)k.buf + i * KEY, KEY);
        memcpy(h + 88, (const unsigned char *)s.buf + i * 8, 8);
        memcpy(h + 120, (const unsigned char *)p.buf + i * KEY, KEY);
        put32(h + CRC_AT, crc32(0, h, CRC_AT));
        /* The magic last, after a release fence: written in one memcpy, magic first, the header
         * was for a moment the slot's old one again (libc stores the first 32 bytes, which old and
         * new share, before the key and time) over the new payload, and a reader's after-copy
         * check (first_changed) landing there took another key's bytes for its own. */
        unsigned char *slot = addr_at(&a, i);
        memcpy(slot + 8, h + 8, FIELDS - 8);
        atomic_thread_fence(memory_order_release);
        memcpy(slot, h, 8);
    }
    take_gil_back(saved);
    PyBuffer_Release(&s);
    PyBuffer_Release(&p);
    PyBuffer_Release(&k);
    PyBuffer_Release(&f);
    PyBuffer_Release(&a);
    Py_RETURN_NONE;
e3:
    PyBuffer_Release(&p);
e2:
    PyBuffer_Release(&k);
e1:
    PyBuffer_Release(&f);
e0:
    PyBuffer_Release(&a);
    return NULL;
}

/* clear_headers(addrs): zero the magic of each slot before its payload is overwritten. */
static PyObject *clear_headers(PyObject *self, PyObject *arg) {
    Py_buffer a;
    Py_ssize_t n;
    if (get_addrs(arg, &a, &n) < 0) return NULL;
    PyThreadState *saved = PyEval_SaveThread();
    for (Py_ssize_t i = 0; i < n; i++) memset(addr_at(&a, i), 0, 8);
    take_gil_back(saved);
    PyBuffer_Release(&a);
    Py_RETURN_NONE;
}

/* True if bytes [FIELDS, HEADER_SIZE) are zero: one memcmp (vectorized in libc); a byte loop with
 * an early exit costs about 3 us per header. */
static const unsigned char ZEROS[HEADER_SIZE - FIELDS];

static int zero_tail(const unsigned char *h) { return memcmp(h + FIELDS, ZEROS, sizeof ZEROS) == 0; }

/* Why a header fails pool_format.parse_header's checks plus the slot's expected key and
 * creation time; NULL when it passes. */
static const char *header_fault(const unsigned char *h, const unsigned char *tail_of, const unsigned char *fp,
                                const unsigned char *key, uint64_t created, uint64_t payload_len) {
    if (memcmp(h, MAGIC, 8)) return "bad magic";
    if (get32(h + 8) != 1) return "unsupported format version";
    if (get32(h + 12) != HEADER_SIZE) return "bad header_size";
    if (get32(h + CRC_AT) != crc32(0, h, CRC_AT)) return "header checksum mismatch";
    if (!zero_tail(tail_of)) return "non-zero bytes in the reserved header tail";
    if (get32(h + 112) || get32(h + 116)) return "unknown flags / reserved";
    if (get32(h + 96) != 1) return "unknown checksum algorithm";
    uint64_t plen = get64(h + 80);
    uint32_t tpb = get32(h + 100);
    if (plen == 0 || plen > MAX_PAYLOAD) return "payload_len out of bounds";
    if (tpb == 0 || tpb > (1u << 20)) return "tokens_per_block out of bounds";
    if (memcmp(h + 16, fp, KEY)) return "fingerprint differs from this pool's";
    if (plen != payload_len) return "payload_len differs from the block size";
    if (memcmp(h + 48, key, KEY)) return "slot holds another key's record than its reference names (reused)";
    if (get64(h + 104) != created) return "slot holds a newer record of this key than its reference (reused)";
    return NULL;
}

/* check_headers(addrs, fingerprint, keys, created, payload_len) -> (fields, sums, bad, reason)
 *
 * Checks each slot's header (at addrs[i]) as pool_format.parse_header does, and that it names
 * keys[i] written at created[i].  Stops at the first slot that fails: bad is its index and reason
 * why (bad = -1 and reason None when all pass).  fields holds the 156 field bytes of the slots
 * checked, for unchanged() after the copy; sums (uint64 bytes) their payload checksums. */
static PyObject *check_headers(PyObject *self, PyObject *args) {
    PyObject *ao, *fo, *ko, *co;
    unsigned long long plen;
    if (!PyArg_ParseTuple(args, "OOOOK", &ao, &fo, &ko, &co, &plen)) return NULL;
    Py_buffer a, f, k, c;
    Py_ssize_t n;
    if (get_addrs(ao, &a, &n) < 0) return NULL;
    PyObject *fields = NULL, *sums = NULL, *out = NULL;
    if (get_buf(fo, &f, KEY, "fingerprint") < 0) goto e0;
    if (get_buf(ko, &k, n * KEY, "keys") < 0) goto e1;
    if (get_buf(co, &c, n * 8, "created") < 0) goto e2;
    unsigned char *fb = malloc((size_t)(n ? n : 1) * FIELDS);
    unsigned char *sb = malloc((size_t)(n ? n : 1) * 8);
    if (!fb || !sb) {
        PyErr_NoMemory();
        goto e4;
    }
    Py_ssize_t bad = -1;
    const char *why = NULL;
    PyThreadState *saved = PyEval_SaveThread();
    for (Py_ssize_t i = 0; i < n; i++) {
        /* One snapshot of the fields, magic first (write_headers writes it last), is both what is
         * checked and what first_changed compares after the copy: checked live and copied in a
         * second read, a slot rewritten in between gave the check the old key and the snapshot
         * the new one, and the copy of the new payload then passed as unchanged. */
        const unsigned char *h = addr_at(&a, i);
        unsigned char *snap = fb + i * FIELDS;
        memcpy(snap, h, 8);
        atomic_thread_fence(memory_order_acquire);
        memcpy(snap + 8, h + 8, FIELDS - 8);
        why = header_fault(snap, h, f.buf, (const unsigned char *)k.buf + i * KEY,
                           get64((const unsigned char *)c.buf + i * 8), plen);
        if (why) {
            bad = i;
            break;
        }
        memcpy(sb + i * 8, snap + 88, 8);
    }
    take_gil_back(saved);
    Py_ssize_t good = bad < 0 ? n : bad;
    fields = PyBytes_FromStringAndSize((const char *)fb, good * FIELDS);
    sums = PyBytes_FromStringAndSize((const char *)sb, good * 8);
    if (fields && sums) {
        if (why)
            out = Py_BuildValue("(OOns)", fields, sums, bad, why);
        else
            out = Py_BuildValue("(OOnO)", fields, sums, bad, Py_None);
    }
    Py_XDECREF(fields);
    Py_XDECREF(sums);
e4:
    free(fb);
    free(sb);
    PyBuffer_Release(&c);
e2:
    PyBuffer_Release(&k);
e1:
    PyBuffer_Release(&f);
e0:
    PyBuffer_Release(&a);
    return out;
}

/* first_changed(addrs, fields) -> index of the first slot whose 156 header field bytes differ
 * from fields[i*156:(i+1)*156], or -1: the after-copy half of the arena's seqlock. */
static PyObject *first_changed(PyObject *self, PyObject *args) {
    PyObject *ao, *fo;
    if (!PyArg_ParseTuple(args, "OO", &ao, &fo)) return NULL;
    Py_buffer a, f;
    Py_ssize_t n;
    if (get_addrs(ao, &a, &n) < 0) return NULL;
    if (get_buf(fo, &f, n * FIELDS, "fields") < 0) {
        PyBuffer_Release(&a);
        return NULL;
    }
    Py_ssize_t hit = -1;
    PyThreadState *saved = PyEval_SaveThread();
    for (Py_ssize_t i = 0; i < n; i++) {
        /* the magic first (write_headers writes it last): a slot being rewritten has it zero until
         * all its new fields are in place, so unchanged fields after it are the ones checked */
        const unsigned char *h = addr_at(&a, i), *was = (const unsigned char *)f.buf + i * FIELDS;
        int changed = memcmp(h, was, 8) != 0;
        atomic_thread_fence(memory_order_acquire);
        if (changed || memcmp(h + 8, was + 8, FIELDS - 8)) {
            hit = i;
            break;
        }
    }
    take_gil_back(saved);
    PyBuffer_Release(&f);
    PyBuffer_Release(&a);
    return PyLong_FromSsize_t(hit);
}

/* The slab guard (arena.py): a slab's pages can be taken from under its mappings at any time, by
 * another process that truncates the file (to any size) or by a full tmpfs that cannot give a page
 * of a sparse slab.  The next CPU access there raises SIGBUS, whose default action kills the
 * process, however the access was made: the loops above, ctypes, numpy, torch, mmap slicing.  So
 * every slab mapping is entered in `guards`, and a SIGBUS whose address lies in one is survived:
 * the handler maps anonymous memory over the whole range (MAP_FIXED, the mapping's protection),
 * marks it lost and returns, and the access runs again on the new pages, reading zeros or writing
 * where no other process reads.  The arena asks guard_lost() before it uses a slab and checks slot
 * headers after each copy, so bytes read from a lost range are never taken for a block.  A SIGBUS
 * anywhere else goes to the action that was there before this handler (once; the default after
 * that, so two handlers that each hand over to the other cannot loop), as if it had never been
 * installed.  GPU DMA into cudaHostRegister'ed pages never faults (the pages stay pinned), so only
 * CPU accesses need this.
 *
 * The table is written only under the GIL (guard, unguard) and read by the handler on any thread:
 * an entry's len is stored last when it is filled and first when it is emptied. */
#define GUARDS (1 << 16) /* slab mappings at once: a host-memory pool of 16 TiB in 256 MiB slabs */

struct guard {
    _Atomic uintptr_t start;
    _Atomic size_t len; /* 0: a free entry */
    int prot;
    atomic_int lost; /* 0 intact, 1 while the handler maps over it, 2 once it has */
};

static struct guard guards[GUARDS];
static atomic_size_t guard_top;   /* entries at and above this one were never used */
static atomic_long guards_lost;   /* ranges lost so far: guard_lost() is one load while none is */
static struct sigaction bus_before; /* the SIGBUS action this handler replaced */
static atomic_int bus_passed_on;

/* Not a slab's fault: the action from before takes it (the default after the first time).  A
 * fault happens again once this returns; a SIGBUS sent with kill(2) is sent again. */
static void pass_on(int sig, const siginfo_t *si) {
    if (atomic_exchange(&bus_passed_on, 1)) {
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigaction(sig, &dfl, NULL);
    } else {
        sigaction(sig, &bus_before, NULL);
    }
    if (si->si_code <= 0) raise(sig);
}

static void on_sigbus(int sig, siginfo_t *si, void *ctx) {
    int saved_errno = errno;
    if (si->si_code > 0) { /* raised by a fault, not sent */
        uintptr_t at = (uintptr_t)si->si_addr;
        size_t top = atomic_load(&guard_top);
        for (size_t i = 0; i < top; i++) {
            struct guard *g = &guards[i];
            size_t len = atomic_load_explicit(&g->len, memory_order_acquire);
            uintptr_t start = atomic_load_explicit(&g->start, memory_order_relaxed);
            if (!len || at - start >= len) continue;
            int intact = 0;
            if (atomic_compare_exchange_strong(&g->lost, &intact, 1)) {
                if (mmap((void *)start, len, g->prot, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) == MAP_FAILED)
                    break; /* cannot be survived: as if there were no guard */
                atomic_store(&g->lost, 2);
                atomic_fetch_add(&guards_lost, 1);
            }
            /* lost == 1: another thread is mapping over it, and this access faults until it has */
            errno = saved_errno;
            return;
        }
    }
    pass_on(sig, si);
    errno = saved_errno;
}

/* Installs on_sigbus unless it is the SIGBUS action already (again after someone replaced it, such as
 * faulthandler.enable() after the first slab was mapped). */
static int arm_sigbus(void) {
    struct sigaction now, mine;
    if (sigaction(SIGBUS, NULL, &now) < 0) return -1;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus) return 0;
    memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = on_sigbus;
    mine.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&mine.sa_mask);
    bus_before = now;
    atomic_store(&bus_passed_on, 0);
    return sigaction(SIGBUS, &mine, NULL);
}

/* guard(addr, nbytes, writable): survive SIGBUS in [addr, addr + nbytes) from now on (see above). */
static PyObject *guard(PyObject *self, PyObject *args) {
    unsigned long long addr, len;
    int writable;
    if (!PyArg_ParseTuple(args, "KKp", &addr, &len, &writable)) return NULL;
    if (!len) {
        PyErr_SetString(PyExc_ValueError, "an empty range");
        return NULL;
    }
    if (arm_sigbus() < 0) return PyErr_SetFromErrno(PyExc_OSError);
    size_t top = atomic_load(&guard_top), i = 0;
    while (i < top && atomic_load(&guards[i].len)) i++;
    if (i == GUARDS) {
        PyErr_Format(PyExc_OSError, "more than %d slab mappings to guard", GUARDS);
        return NULL;
    }
    struct guard *g = &guards[i];
    g->prot = PROT_READ | (writable ? PROT_WRITE : 0);
    atomic_store(&g->lost, 0);
    atomic_store_explicit(&g->start, (uintptr_t)addr, memory_order_relaxed);
    atomic_store_explicit(&g->len, (size_t)len, memory_order_release);
    if (i == top) atomic_store(&guard_top, top + 1);
    Py_RETURN_NONE;
}

/* The entry guarding the range that starts at addr, or NULL. */
static struct guard *guard_at(uintptr_t addr) {
    size_t top = atomic_load(&guard_top);
    for (size_t i = 0; i < top; i++)
        if (atomic_load(&guards[i].len) && atomic_load(&guards[i].start) == addr) return &guards[i];
    return NULL;
}

/* unguard(addr): the range starting at addr is about to be unmapped; a later fault there is not a slab's. */
static PyObject *unguard(PyObject *self, PyObject *arg) {
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    struct guard *g = guard_at((uintptr_t)addr);
    if (g) atomic_store_explicit(&g->len, 0, memory_order_release);
    Py_RETURN_NONE;
}

/* guard_lost(addr) -> bool: whether a fault replaced the guarded range starting at addr. */
static PyObject *guard_lost(PyObject *self, PyObject *arg) {
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    if (!atomic_load(&guards_lost)) Py_RETURN_FALSE;
    struct guard *g = guard_at((uintptr_t)addr);
    return PyBool_FromLong(g && atomic_load(&g->lost));
}

/* arm_guard(): install the handler again where another replaced it since (arena's periodic sweep). */
static PyObject *arm_guard(PyObject *self, PyObject *unused) {
    if (atomic_load(&guard_top) && arm_sigbus() < 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* The 256 key directories of a pool (pool._key_dirs) as UTF-8, kept alive by the str objects in
 * the tuple; *longest is the longest one's length. */
static int key_dirs(PyObject *dirs, const char **dir_of, size_t *dir_len, size_t *longest) {
    if (!PyTuple_Check(dirs) || PyTuple_Size(dirs) != 256) {
        PyErr_SetString(PyExc_TypeError, "dirs must be a tuple of 256 str");
        return -1;
    }
    *longest = 0;
    for (int b = 0; b < 256; b++) {
        Py_ssize_t len;
        dir_of[b] = PyUnicode_AsUTF8AndSize(PyTuple_GetItem(dirs, b), &len);
        if (!dir_of[b]) return -1;
        dir_len[b] = (size_t)len;
        if (dir_len[b] > *longest) *longest = dir_len[b];
    }
    return 0;
}

/* keys[start:start+n] (a list of 32-byte bytes) as pointers into the bytes objects. */
static int key_ptrs(PyObject *keys, Py_ssize_t start, Py_ssize_t n, const unsigned char **key_at) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GetItem(keys, start + i);
        if (!PyBytes_Check(k) || PyBytes_Size(k) != KEY) {
            PyErr_SetString(PyExc_TypeError, "keys must be 32-byte bytes");
            return -1;
        }
        key_at[i] = (const unsigned char *)PyBytes_AsString(k);
    }
    return 0;
}

/* "<dir of k[0]>/<64 hex digits of k><suffix>" into path (pool.path_for, fileops.key_name). */
static void key_path(char *path, const char **dir_of, const size_t *dir_len, const unsigned char *k,
                     const char *suffix, size_t suffix_len) {
    static const char HEX[] = "0123456789abcdef";
    char *p = path;
    memcpy(p, dir_of[k[0]], dir_len[k[0]]);
    p += dir_len[k[0]];
    *p++ = '/';
    for (int j = 0; j < KEY; j++) {
        *p++ = HEX[k[j] >> 4];
        *p++ = HEX[k[j] & 15];
    }
    memcpy(p, suffix, suffix_len + 1);
}

/* The writers a pool trusts (store/pool.py PoolTrust, docs/format.md "Trust"): a file no trusted
 * writer could have made is a miss where it is matched, not a promise its load would break. */
#define TRUST_MAX 64
struct trust {
    int on;
    Py_ssize_t nu, ng;
    unsigned long uids[TRUST_MAX], gids[TRUST_MAX];
};

/* (uids, gids) tuples of ints into t; None leaves it off.  0 and an exception on a bad value. */
static int parse_trust(PyObject *obj, struct trust *t) {
    t->on = 0;
    t->nu = t->ng = 0;
    if (obj == NULL || obj == Py_None) return 1;
    PyObject *uids, *gids;
    if (!PyArg_ParseTuple(obj, "OO", &uids, &gids) || !PyTuple_Check(uids) || !PyTuple_Check(gids) ||
            PyTuple_Size(uids) > TRUST_MAX || PyTuple_Size(gids) > TRUST_MAX) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "trust must be (uids, gids), tuples of at most 64 ints");
        return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_Size(uids); i++) {
        t->uids[t->nu++] = PyLong_AsUnsignedLong(PyTuple_GetItem(uids, i));
    }
    for (Py_ssize_t i = 0; i < PyTuple_Size(gids); i++) {
        t->gids[t->ng++] = PyLong_AsUnsignedLong(PyTuple_GetItem(gids, i));
    }
    if (PyErr_Occurred()) return 0;
    t->on = 1;
    return 1;
}

/* format/trust.py why_untrusted is None: owned by a trusted uid or the trusted group, not writable by
 * others, group-writable only for the trusted group. */
static int trusted(const struct trust *t, const struct stat *st) {
    if (t == NULL || !t->on) return 1;
    int uid_ok = 0, gid_ok = 0;
    for (Py_ssize_t i = 0; i < t->nu; i++) uid_ok |= t->uids[i] == (unsigned long)st->st_uid;
    for (Py_ssize_t i = 0; i < t->ng; i++) gid_ok |= t->gids[i] == (unsigned long)st->st_gid;
    if (!uid_ok && !gid_ok) return 0;
    if (st->st_mode & S_IWOTH) return 0;
    if ((st->st_mode & S_IWGRP) && !gid_ok) return 0;
    return 1;
}

/* The size of key k's block file (named into path), or -1 where it is missing, is not a regular file,
 * fails to stat or was made by no writer ``trust`` names: the one lookup present_run and chain_present
 * make per key (links never followed). */
static long long key_file_size(char *path, const char **dir_of, const size_t *dir_len, const unsigned char *k,
                               const char *suffix, size_t suffix_len, const struct trust *trust) {
    struct stat st;
    key_path(path, dir_of, dir_len, k, suffix, suffix_len);
    if (lstat(path, &st) || !S_ISREG(st.st_mode) || !trusted(trust, &st)) return -1;
    return (long long)st.st_size;
}

/* link_keys(src, dirs, keys, suffix) -> list of errno values, 0 where link(2) succeeded
 *
 * Publishes one arena reference file under every key of a save batch (pool.publish_refs), at
 * "<dirs[key[0]]>/<64 hex digits><suffix>" (pool.path_for).  Each link is a system call, a few
 * microseconds (more in a sandboxed kernel), and the loop holds no GIL; the names are
 * formatted here too, so the transfer thread spends no GIL-held time per key on them. */
static PyObject *link_keys(PyObject *self, PyObject *args) {
    const char *src, *suffix;
    PyObject *dirs, *keys;
    if (!PyArg_ParseTuple(args, "sOOs", &src, &dirs, &keys, &suffix)) return NULL;
    if (!PyList_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "keys must be a list of bytes");
        return NULL;
    }
    const char *dir_of[256];
    size_t dir_len[256], longest, suffix_len = strlen(suffix);
    if (key_dirs(dirs, dir_of, dir_len, &longest) < 0) return NULL;
    Py_ssize_t n = PyList_Size(keys);
    const unsigned char **key_at = malloc((size_t)(n ? n : 1) * sizeof *key_at);
    int *errs = malloc((size_t)(n ? n : 1) * sizeof *errs);
    char *path = malloc(longest + 2 + 2 * KEY + suffix_len);
    PyObject *out = NULL, *held = NULL;
    if (!key_at || !errs || !path) {
        PyErr_NoMemory();
        goto done;
    }
    /* A copy of the list holds a reference to every key, so none is freed while the GIL is released,
     * even if another thread edits the caller's list (the call's arguments keep the tuple of directories). */
    if (!(held = PyList_GetSlice(keys, 0, n)) || key_ptrs(held, 0, n, key_at) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        key_path(path, dir_of, dir_len, key_at[i], suffix, suffix_len);
        errs[i] = linkat(AT_FDCWD, src, AT_FDCWD, path, 0) ? errno : 0;
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *e = PyLong_FromLong(errs[i]);
        if (!e) Py_CLEAR(out);
        else PyList_SetItem(out, i, e);
    }
done:
    Py_XDECREF(held);
    free(key_at);
    free(errs);
    free(path);
    return out;
}

/* present_run(dirs, keys, start, suffix) -> list of sizes
 *
 * lstat(2) of "<dirs[key[0]]>/<64 hex digits><suffix>" for keys[start], keys[start+1], ... up to
 * the first that is missing or not a regular file: the sizes of the regular files before it
 * (pool.count_present's files; the caller checks the sizes).  Every error, ENOENT or another,
 * ends the run, as a failed stat makes BlockPool.contains say False.  It runs on the executor
 * thread when a prompt is matched, nearly always for one key (the first block not yet saved), so
 * the GIL is kept for the first STAT_HOLD_GIL stats: the first GIL-releasing call after a stretch of
 * the executor's Python can cost 17-20 us against 2-3 us for the same lstat with the GIL held, even
 * with no other thread running (on other kernels both take 1-5 us).  It is the hand-off
 * RELEASE_MIN_BLOCKS avoids
 * for chain_keys.  Longer runs (a prompt another process saved and this one has not indexed)
 * release it for the rest, which is split over up to STAT_THREADS threads of STAT_SPAN_MIN keys or
 * more: a stat is about 1 us of path walk, so a 128k-token prompt's 4096 files take about 4 ms on
 * one thread. */
#define STAT_HOLD_GIL 8
#define STAT_THREADS 8
#define STAT_SPAN_MIN 256

/* One thread's share of a long present_run: stats keys [from, to) in order, stopping at the first
 * that is missing or not a regular file, whose index it leaves in fail (to where none is). */
struct stat_span {
    const unsigned char **key_at;
    const char **dir_of;
    const size_t *dir_len;
    const char *suffix;
    size_t suffix_len;
    char *path;
    long long *sizes;
    Py_ssize_t from, to, fail;
    const struct trust *trust;
};

static void *stat_span_run(void *arg) {
    struct stat_span *sp = arg;
    sp->fail = sp->to;
    for (Py_ssize_t i = sp->from; i < sp->to; i++) {
        long long size = key_file_size(sp->path, sp->dir_of, sp->dir_len, sp->key_at[i], sp->suffix, sp->suffix_len,
                                       sp->trust);
        if (size < 0) {
            sp->fail = i;
            break;
        }
        sp->sizes[i] = size;
    }
    return NULL;
}

/* Threads for stat'ing n keys: one per STAT_SPAN_MIN keys, at least one, at most STAT_THREADS. */
static int stat_threads_for(Py_ssize_t n) {
    Py_ssize_t k = n / STAT_SPAN_MIN;
    return k < 1 ? 1 : k > STAT_THREADS ? STAT_THREADS : (int)k;
}

/* Stats keys [from, n) on up to STAT_THREADS threads, each a contiguous span of at least
 * STAT_SPAN_MIN keys (this thread takes the first): the index of the first key that failed, n where
 * none did.  Spans after a failure are wasted work, never a wrong answer. */
static Py_ssize_t stat_spans(const unsigned char **key_at, const char **dir_of, const size_t *dir_len,
                             const char *suffix, size_t suffix_len, char *paths, size_t path_cap,
                             long long *sizes, Py_ssize_t from, Py_ssize_t n, const struct trust *trust) {
    struct stat_span sp[STAT_THREADS];
    pthread_t tid[STAT_THREADS];
    int started[STAT_THREADS] = {0};
    Py_ssize_t left = n - from;
    int k = stat_threads_for(left);
    for (int t = 0; t < k; t++) {
        sp[t] = (struct stat_span){key_at, dir_of, dir_len, suffix, suffix_len, paths + t * path_cap, sizes,
                                   from + left * t / k, from + left * (t + 1) / k, 0, trust};
    }
    for (int t = 1; t < k; t++) started[t] = pthread_create(&tid[t], NULL, stat_span_run, &sp[t]) == 0;
    stat_span_run(&sp[0]);
    Py_ssize_t first_fail = n;
    for (Py_ssize_t t = 0; t < k; t++) {
        if (t && started[t]) pthread_join(tid[t], NULL);
        else if (t) stat_span_run(&sp[t]); /* no thread could be started: this one stats the span */
        if (sp[t].fail < sp[t].to && sp[t].fail < first_fail) first_fail = sp[t].fail;
    }
    return first_fail;
}

static PyObject *present_run(PyObject *self, PyObject *args) {
    const char *suffix;
    PyObject *dirs, *keys, *trust_obj = NULL;
    Py_ssize_t start;
    struct trust trust;
    if (!PyArg_ParseTuple(args, "OOns|O", &dirs, &keys, &start, &suffix, &trust_obj)) return NULL;
    if (!parse_trust(trust_obj, &trust)) return NULL;
    if (!PyTuple_Check(dirs) || PyTuple_Size(dirs) != 256 || !PyList_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "dirs must be a tuple of 256 str, keys a list of bytes");
        return NULL;
    }
    Py_ssize_t n = PyList_Size(keys);
    if (start < 0 || start > n) {
        PyErr_SetString(PyExc_ValueError, "start is outside keys");
        return NULL;
    }
    n -= start;
    /* Only the directories of the keys stat'ed are resolved (the usual call stats one key). */
    const char *dir_of[256] = {NULL};
    size_t dir_len[256], longest = 0, suffix_len = strlen(suffix);
    const unsigned char **key_at = malloc((size_t)(n ? n : 1) * sizeof *key_at);
    long long *sizes = malloc((size_t)(n ? n : 1) * sizeof *sizes);
    char *path = NULL;
    PyObject *out = NULL, *held = NULL;
    if (!key_at || !sizes) {
        PyErr_NoMemory();
        goto done;
    }
    /* a copy of the run holds a reference to every key (see link_keys) */
    if (!(held = PyList_GetSlice(keys, start, start + n)) || key_ptrs(held, 0, n, key_at) < 0) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char b = key_at[i][0];
        if (dir_of[b]) continue;
        Py_ssize_t len;
        dir_of[b] = PyUnicode_AsUTF8AndSize(PyTuple_GetItem(dirs, b), &len);
        if (!dir_of[b]) goto done;
        dir_len[b] = (size_t)len;
        if (dir_len[b] > longest) longest = dir_len[b];
    }
    size_t path_cap = longest + 2 + 2 * KEY + suffix_len;
    if (!(path = malloc(path_cap * STAT_THREADS))) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t found = 0;
    for (; found < n && found < STAT_HOLD_GIL; found++) {
        long long size = key_file_size(path, dir_of, dir_len, key_at[found], suffix, suffix_len, &trust);
        if (size < 0) break;
        sizes[found] = size;
    }
    if (found == STAT_HOLD_GIL && found < n) { /* a long run: the rest on threads, the GIL released */
        Py_BEGIN_ALLOW_THREADS
        found = stat_spans(key_at, dir_of, dir_len, suffix, suffix_len, path, path_cap, sizes, found, n, &trust);
        Py_END_ALLOW_THREADS
    }
    out = PyList_New(found);
    for (Py_ssize_t i = 0; out && i < found; i++) {
        PyObject *v = PyLong_FromLongLong(sizes[i]);
        if (!v) Py_CLEAR(out);
        else PyList_SetItem(out, i, v);
    }
done:
    Py_XDECREF(held);
    free(key_at);
    free(sizes);
    free(path);
    return out;
}

/* chain_present(prev, tokens, start, tokens_per_block, n, dirs, suffix) -> (keys, sizes)
 *
 * chain_keys(prev, tokens, start, tokens_per_block, n) and present_run(dirs, keys, 0, suffix) in one
 * call whose stats overlap the hashing.  It is the match of a long prompt whose first block this
 * process has not indexed (another process or node saved it, or nobody did): the key chain of its
 * 4096 blocks takes about 1.5 ms and the stats of their files as long again after it.  Here the executor thread converts the tokens, one thread hashes behind
 * it, and up to STAT_THREADS threads take chunks of PROBE_CHUNK keys, in order, as soon as they are
 * hashed, and stat them; none takes a chunk past the lowest key found missing, so a prompt that is
 * not in the pool costs a few stats. */
#define PROBE_CHUNK 16

struct probe {
    struct chain_job *job;
    const char **dir_of;
    const size_t *dir_len;
    const char *suffix;
    size_t suffix_len;
    long long *sizes;
    Py_ssize_t n;
    atomic_long next; /* the first key of the next chunk to take */
    atomic_long fail; /* the lowest key found missing or not a regular file (n: none yet) */
    int threads;      /* stat threads wanted, the first included */
    struct probe_thread *pt;
    pthread_t tid[STAT_THREADS];
    int started[STAT_THREADS];
    const struct trust *trust;
};

struct probe_thread {
    struct probe *p;
    char *path;
};

static void *probe_run(void *arg);

/* Run by the first stat thread once the first chunk is present: the other stat threads.  A prompt
 * whose first block is missing (not in the pool at all, the usual miss) so costs one thread. */
static void probe_spawn(struct probe *p) {
    for (int t = 1; t < p->threads; t++)
        p->started[t] = pthread_create(&p->tid[t], NULL, probe_run, &p->pt[t]) == 0;
}

static void *probe_run(void *arg) {
    struct probe_thread *t = arg;
    struct probe *p = t->p;
    for (int chunks = 0;; chunks++) {
        if (chunks == 1 && t == p->pt) probe_spawn(p);
        long lo = atomic_fetch_add(&p->next, PROBE_CHUNK);
        if (lo >= p->n || lo > atomic_load(&p->fail)) return NULL;
        long hi = lo + PROBE_CHUNK < p->n ? lo + PROBE_CHUNK : (long)p->n;
        /* wait for the hasher, yielding first and then sleeping, so waiting threads leave the
         * converting and hashing threads their cores on a small machine */
        for (int spins = 0; atomic_load_explicit(&p->job->hashed, memory_order_acquire) < hi; spins++) {
            if (atomic_load_explicit(&p->job->abort, memory_order_relaxed)) return NULL;
            if (spins < 16) sched_yield();
            else nanosleep(&(struct timespec){0, 20000}, NULL);
        }
        for (long i = lo; i < hi; i++) {
            long long size = key_file_size(t->path, p->dir_of, p->dir_len, p->job->keys + i * KEY, p->suffix,
                                           p->suffix_len, p->trust);
            if (size < 0) {
                long cur = atomic_load(&p->fail);
                while (i < cur && !atomic_compare_exchange_weak(&p->fail, &cur, i)) {
                }
                return NULL;
            }
            p->sizes[i] = size;
        }
    }
}

static PyObject *chain_present(PyObject *self, PyObject *args) {
    PyObject *prev_obj, *tokens, *dirs, *trust_obj = NULL;
    Py_ssize_t start, tpb, n;
    const char *suffix;
    int is_list;
    struct trust trust;
    if (!PyArg_ParseTuple(args, "OOnnnOs|O", &prev_obj, &tokens, &start, &tpb, &n, &dirs, &suffix, &trust_obj))
        return NULL;
    if (!parse_trust(trust_obj, &trust)) return NULL;
    if (chain_check(tokens, start, tpb, n, &is_list) < 0) return NULL;
    const char *dir_of[256];
    size_t dir_len[256], longest, suffix_len = strlen(suffix);
    if (key_dirs(dirs, dir_of, dir_len, &longest) < 0) return NULL;
    Py_buffer prev;
    if (get_buf(prev_obj, &prev, KEY, "prev key") < 0) return NULL;
    size_t path_cap = longest + 2 + 2 * KEY + suffix_len;
    int64_t *toks = malloc((size_t)(n && tpb ? n * tpb : 1) * 8);
    unsigned char *keys = malloc((size_t)(n ? n : 1) * KEY);
    long long *sizes = malloc((size_t)(n ? n : 1) * sizeof *sizes);
    char *paths = malloc(path_cap * STAT_THREADS);
    PyObject *out = NULL, *key_out = NULL, *size_out = NULL;
    if (!toks || !keys || !sizes || !paths) {
        PyErr_NoMemory();
        goto done;
    }
    size_t width = (size_t)tpb * 8;
    struct chain_job job = {prev.buf, toks, keys, width, n, 0, 0, 0};
    int threads = stat_threads_for(n);
    struct probe_thread pt[STAT_THREADS];
    struct probe pr = {&job, dir_of, dir_len, suffix, suffix_len, sizes, n, 0, (long)n, threads, pt, {0}, {0}, &trust};
    for (int t = 0; t < STAT_THREADS; t++) pt[t] = (struct probe_thread){&pr, paths + t * path_cap};
    pthread_t hasher;
    int hashing = pthread_create(&hasher, NULL, chain_job_run, &job) == 0;
    int probing = pr.started[0] = pthread_create(&pr.tid[0], NULL, probe_run, &pt[0]) == 0;
    int failed = convert_tokens(tokens, is_list, start, tpb, n, toks, &job) < 0;
    Py_BEGIN_ALLOW_THREADS
    if (hashing) pthread_join(hasher, NULL);
    else if (!failed) { /* no hasher thread: this one hashes, and the stat threads follow it */
        hash_blocks(prev.buf, toks, keys, width, 0, n);
        atomic_store_explicit(&job.hashed, (long)n, memory_order_release);
    }
    if (probing) pthread_join(pr.tid[0], NULL); /* first: it started the others */
    else if (!failed) probe_run(&pt[0]);        /* no stat thread: this one stats (and starts the others) */
    for (int t = 1; t < pr.threads; t++)
        if (pr.started[t]) pthread_join(pr.tid[t], NULL);
    Py_END_ALLOW_THREADS
    if (failed) goto done;
    Py_ssize_t found = atomic_load(&pr.fail);
    if (!(key_out = key_list(keys, n)) || !(size_out = PyList_New(found))) goto done;
    for (Py_ssize_t i = 0; i < found; i++) {
        PyObject *v = PyLong_FromLongLong(sizes[i]);
        if (!v) goto done;
        PyList_SetItem(size_out, i, v);
    }
    out = PyTuple_Pack(2, key_out, size_out);
done:
    Py_XDECREF(key_out);
    Py_XDECREF(size_out);
    free(toks);
    free(keys);
    free(sizes);
    free(paths);
    PyBuffer_Release(&prev);
    return out;
}

static PyMethodDef methods[] = {
    {"link_keys", link_keys, METH_VARARGS, "link_keys(src, dirs, keys, suffix) -> list[int]"},
    {"present_run", present_run, METH_VARARGS, "present_run(dirs, keys, start, suffix) -> list[int]"},
    {"chain_keys", chain_keys, METH_VARARGS, "chain_keys(prev, tokens, start, tokens_per_block, n) -> list[bytes]"},
    {"chain_present", chain_present, METH_VARARGS,
     "chain_present(prev, tokens, start, tokens_per_block, n, dirs, suffix) -> (list[bytes], list[int])"},
    {"write_headers", write_headers, METH_VARARGS,
     "write_headers(addrs, fingerprint, keys, parents, sums, payload_len, algo, tokens_per_block, created_ns)"},
    {"clear_headers", clear_headers, METH_O, "clear_headers(addrs)"},
    {"check_headers", check_headers, METH_VARARGS,
     "check_headers(addrs, fingerprint, keys, created, payload_len) -> (fields, sums, bad, reason)"},
    {"first_changed", first_changed, METH_VARARGS, "first_changed(addrs, fields) -> int"},
    {"guard", guard, METH_VARARGS, "guard(addr, nbytes, writable): survive SIGBUS in that slab mapping"},
    {"unguard", unguard, METH_O, "unguard(addr): the slab mapping at addr is about to be unmapped"},
    {"guard_lost", guard_lost, METH_O, "guard_lost(addr) -> bool: a fault replaced that slab mapping"},
    {"arm_guard", arm_guard, METH_NOARGS, "arm_guard(): the SIGBUS handler again where another replaced it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "Per-block loops of gds_kv_connector in C (see csrc/native.c).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    return PyModule_Create(&module);
}
