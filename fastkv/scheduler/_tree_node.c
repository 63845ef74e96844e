/* The radix tree's per-block state, out of the garbage collector's reach.
 *
 * `TreeNode` holds one cached block: its key, its parent, its state and its block
 * ids and counts as C integers. A node refers only to its key, its parent (up the
 * tree) and the state enum's members, so nodes cannot form reference cycles, and
 * the type does not take part in cyclic garbage collection: a full collection
 * never visits them, and the tree-wide dict that holds only nodes and hash keys is
 * untracked too.
 *
 * `LRUList` is an eviction list threaded through the nodes themselves (two link
 * pairs per node: one for the device list, one for the host list), replacing an
 * OrderedDict: no per-entry allocation, nothing for the collector to traverse. It
 * offers the subset of the OrderedDict API the tree uses, with the same semantics
 * (assigning a key that is already listed keeps its position).
 *
 * Ownership: a list holds a strong reference to each node it links; the links
 * themselves are borrowed. A node records which list holds it in each slot (the
 * list's one-byte id; at most 255 lists exist at once), so a node can be on at
 * most one list per slot, and a list never unlinks a node that another list holds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#define NUM_SLOTS 2
#define NUM_STATES 8
#define NUM_STORAGE 3

typedef struct LRUListObject LRUListObject;
static PyTypeObject TreeNodeType;

#define DIGEST_SIZE 32

/* Field order: what a lookup and a lock read (parent, state, blocks, lock count,
 * device-list owner, key) comes first.
 *
 * The key: a `bytes` of DIGEST_SIZE bytes (a block hash, the only key the cache
 * manager uses) is held inline, its 32 bytes in the node, and `node.key` makes a
 * new bytes object of them when read: no key object per cached block (80 bytes
 * of a `bytes` each). Any other key (tests, tools) is held by reference, with its
 * hash once indexed; an inline key's hash is the bytes hash of its contents. */
typedef struct TreeNodeObject {
    PyObject_HEAD
    PyObject *parent;             /* a TreeNode or None */
    struct TreeNodeObject *hnext; /* the next node in its NodeIndex bucket */
    int32_t device_block;
    int32_t host_block;
    int32_t ref;
    int32_t num_children;
    int32_t num_device_children;
    uint32_t hits; /* saturates at UINT32_MAX: only compared with thresholds < 2**31 */
    uint8_t state;
    uint8_t storage;
    uint8_t indexed;            /* held by a NodeIndex */
    uint8_t inline_key;         /* key.digest holds the key */
    uint8_t owner[NUM_SLOTS];   /* per slot, the id of the LRUList holding it; 0: none */
    union {
        unsigned char digest[DIGEST_SIZE];
        struct {
            PyObject *obj;
            Py_hash_t hash; /* hash(obj), once indexed */
        } ref;
    } key;
    uint32_t prev[NUM_SLOTS]; /* per slot, the arena ids of the list neighbours; 0: none */
    uint32_t next[NUM_SLOTS];
} TreeNodeObject; /* 112 bytes, allocated from the node arena below */

/* -- the node arena ----------------------------------------------------------
 *
 * Nodes live in slabs of SLAB_BYTES, each aligned to its size, of SLAB_SLOTS
 * node-sized slots; slot 0 of each slab holds the slab's header. A node's arena id
 * is its slab's index and its offset in the slab, a 32-bit number (0, slab 0's
 * header, is never a node: it means none), so the eviction lists link nodes with
 * 4-byte ids instead of 8-byte pointers; the slab a node lives in is its address
 * rounded down to SLAB_BYTES. Freed slots are reused, most recently freed first,
 * from the slab with free slots that was opened last; an emptied slab goes back to
 * the system, as pymalloc gives back its empty arenas. Untouched slots cost no
 * memory (the slab is mapped, not written). Only the holder of the GIL uses it. */
#define SLAB_SHIFT 22
#define SLAB_BYTES ((size_t)1 << SLAB_SHIFT)
#define SLAB_SLOTS ((uint32_t)32768)
/* An id is the slab's index above UNIT_BITS bits of the node's offset in its slab
 * in 16-byte units: a shift and a mask each way, no multiply. */
#define UNIT_SHIFT 4
#define UNIT_BITS (SLAB_SHIFT - UNIT_SHIFT)
#define MAX_SLABS ((uint32_t)1 << (32 - UNIT_BITS))

typedef struct Slab {
    uint32_t index;           /* in arena_slabs */
    uint32_t live;            /* nodes allocated from it */
    uint32_t bump;            /* its next never-used slot */
    void *free;               /* freed slots, linked through their first word */
    struct Slab *open_prev;   /* the open list: slabs with a free slot */
    struct Slab *open_next;
    int open;
} Slab;

_Static_assert(sizeof(TreeNodeObject) == 112, "TreeNode: 112 bytes");
_Static_assert(sizeof(Slab) <= sizeof(TreeNodeObject), "a slab header fits slot 0");
_Static_assert(SLAB_SLOTS * sizeof(TreeNodeObject) <= SLAB_BYTES, "a slab holds its slots");
_Static_assert(sizeof(TreeNodeObject) % (1 << UNIT_SHIFT) == 0, "nodes start on 16-byte units");

static char **arena_slabs;     /* by index; NULL where given back */
static uint32_t arena_num_slabs; /* indices in use so far */
static uint32_t arena_cap_slabs;
static Slab *arena_open;        /* the slab to allocate from next */

#define NODE_AT(id) \
    ((TreeNodeObject *)(arena_slabs[(id) >> UNIT_BITS] + \
                        ((size_t)((id) & (((uint32_t)1 << UNIT_BITS) - 1)) << UNIT_SHIFT)))
#define SLAB_OF(node) ((Slab *)((uintptr_t)(node) & ~(uintptr_t)(SLAB_BYTES - 1)))

/* The node's arena id (never 0). */
static inline uint32_t
node_id(TreeNodeObject *node)
{
    Slab *slab = SLAB_OF(node);
    return (slab->index << UNIT_BITS) | (uint32_t)(((char *)node - (char *)slab) >> UNIT_SHIFT);
}

/* The node an id names, NULL for 0. */
static inline TreeNodeObject *
node_at(uint32_t id)
{
    return id == 0 ? NULL : NODE_AT(id);
}

static void
open_push(Slab *slab)
{
    slab->open = 1;
    slab->open_prev = NULL;
    slab->open_next = arena_open;
    if (arena_open != NULL) {
        arena_open->open_prev = slab;
    }
    arena_open = slab;
}

static void
open_remove(Slab *slab)
{
    if (slab->open_prev != NULL) {
        slab->open_prev->open_next = slab->open_next;
    }
    else {
        arena_open = slab->open_next;
    }
    if (slab->open_next != NULL) {
        slab->open_next->open_prev = slab->open_prev;
    }
    slab->open = 0;
}

/* Maps a new slab aligned to its size and opens it; -1 with MemoryError set. */
static int
arena_grow(void)
{
    uint32_t index = 0;
    while (index < arena_num_slabs && arena_slabs[index] != NULL) {
        index++;
    }
    if (index == MAX_SLABS) {
        PyErr_Format(PyExc_MemoryError, "TreeNode: the arena holds at most %llu nodes",
                     (unsigned long long)MAX_SLABS * (SLAB_SLOTS - 1));
        return -1;
    }
    if (index == arena_cap_slabs) {
        uint32_t cap = arena_cap_slabs ? arena_cap_slabs * 2 : 64;
        char **bigger = PyMem_RawRealloc(arena_slabs, cap * sizeof(char *));
        if (bigger == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        arena_slabs = bigger;
        arena_cap_slabs = cap;
    }
    char *raw = mmap(NULL, 2 * SLAB_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    if (raw == MAP_FAILED) {
        PyErr_NoMemory();
        return -1;
    }
    char *base = (char *)(((uintptr_t)raw + SLAB_BYTES - 1) & ~(uintptr_t)(SLAB_BYTES - 1));
    if (base > raw) {
        munmap(raw, (size_t)(base - raw));
    }
    munmap(base + SLAB_BYTES, (size_t)(raw + 2 * SLAB_BYTES - (base + SLAB_BYTES)));
    Slab *slab = (Slab *)base;
    slab->index = index;
    slab->live = 0;
    slab->bump = 1;
    slab->free = NULL;
    arena_slabs[index] = base;
    if (index == arena_num_slabs) {
        arena_num_slabs++;
    }
    open_push(slab);
    return 0;
}

/* A new TreeNode with its header set and every other field unset. */
static TreeNodeObject *
node_alloc(void)
{
    if (arena_open == NULL && arena_grow() < 0) {
        return NULL;
    }
    Slab *slab = arena_open;
    void *mem = slab->free;
    if (mem != NULL) {
        slab->free = *(void **)mem;
    }
    else {
        mem = (char *)slab + (size_t)slab->bump++ * sizeof(TreeNodeObject);
    }
    slab->live++;
    if (slab->free == NULL && slab->bump == SLAB_SLOTS) {
        open_remove(slab);
    }
    return (TreeNodeObject *)PyObject_Init((PyObject *)mem, &TreeNodeType);
}

/* Gives a node's slot back; an emptied slab goes back to the system unless it is
 * the only one open (a tree that fills and empties one slab keeps it). */
static void
node_free(TreeNodeObject *node)
{
    Slab *slab = SLAB_OF(node);
    *(void **)node = slab->free;
    slab->free = node;
    slab->live--;
    if (!slab->open) {
        open_push(slab);
    }
    if (slab->live == 0 && (slab->open_prev != NULL || slab->open_next != NULL)) {
        open_remove(slab);
        arena_slabs[slab->index] = NULL;
        munmap(slab, SLAB_BYTES);
    }
}

/* LRUList ids: a node records which list holds it in one byte per slot. At most
 * MAX_LISTS lists exist at once (a tree has two). */
#define MAX_LISTS 255
static LRUListObject *lists_by_id[MAX_LISTS + 1];

struct LRUListObject {
    PyObject_HEAD
    TreeNodeObject *head; /* oldest */
    TreeNodeObject *tail; /* newest */
    uint32_t head_id;     /* their arena ids (0 when empty) */
    uint32_t tail_id;
    uint8_t id;           /* its index in lists_by_id (1..MAX_LISTS) */
    Py_ssize_t size;
    uint64_t version; /* changes on every link or unlink: iterators check it */
    int slot;
};

static PyTypeObject LRUListType;
static PyTypeObject LRUIterType;

/* The NodeState and StorageState members, indexed by value (set once by
 * radix_tree.py on import): from then on the fields return the members. */
static PyObject *states[NUM_STATES];
static PyObject *storage_states[NUM_STORAGE];

#define TreeNode_Check(op) Py_IS_TYPE((op), &TreeNodeType)

/* -- integer fields ------------------------------------------------------- */

/* Converts `value` for field `name` within [lo, hi]; raises TypeError for a
 * non-int and OverflowError naming the field, value and bounds otherwise. */
static int
as_bounded(PyObject *value, const char *name, long long lo, long long hi, long long *out)
{
    if (value == NULL) {
        PyErr_Format(PyExc_AttributeError, "TreeNode.%s cannot be deleted", name);
        return -1;
    }
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "TreeNode.%s: must be an int, got %.100s", name,
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow || v < lo || v > hi) {
        PyErr_Format(PyExc_OverflowError, "TreeNode.%s: %R is out of range [%lld, %lld]",
                     name, value, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

#define INT_FIELD(field, lo, hi)                                                    \
    static PyObject *node_get_##field(TreeNodeObject *self, void *closure)         \
    {                                                                               \
        return PyLong_FromLongLong((long long)self->field);                         \
    }                                                                               \
    static int node_set_##field(TreeNodeObject *self, PyObject *value, void *closure) \
    {                                                                               \
        long long v;                                                                \
        if (as_bounded(value, #field, (lo), (hi), &v) < 0) {                        \
            return -1;                                                              \
        }                                                                           \
        self->field = (__typeof__(self->field))v;                                   \
        return 0;                                                                   \
    }

INT_FIELD(device_block, -1, INT32_MAX)
INT_FIELD(host_block, -1, INT32_MAX)
INT_FIELD(ref, 0, INT32_MAX)
INT_FIELD(num_children, 0, INT32_MAX)
INT_FIELD(num_device_children, 0, INT32_MAX)
static PyObject *
node_get_hits(TreeNodeObject *self, void *closure)
{
    return PyLong_FromUnsignedLong(self->hits);
}

/* Takes any count in [0, INT64_MAX] and keeps at most UINT32_MAX of it. */
static int
node_set_hits(TreeNodeObject *self, PyObject *value, void *closure)
{
    long long v;
    if (as_bounded(value, "hits", 0, INT64_MAX, &v) < 0) {
        return -1;
    }
    self->hits = v > (long long)UINT32_MAX ? UINT32_MAX : (uint32_t)v;
    return 0;
}
/* An enum-valued uint8 field: reads give the member of `table` (a bare int only
 * before the members are installed), writes take a member or an int in range. */
#define ENUM_FIELD(field, table, n)                                                 \
    static PyObject *node_get_##field(TreeNodeObject *self, void *closure)         \
    {                                                                               \
        PyObject *m = (table)[self->field];                                         \
        if (m == NULL) {                                                            \
            return PyLong_FromLong(self->field);                                    \
        }                                                                           \
        Py_INCREF(m);                                                               \
        return m;                                                                   \
    }                                                                               \
    static int node_set_##field(TreeNodeObject *self, PyObject *value, void *closure) \
    {                                                                               \
        for (int i = 0; value != NULL && i < (n); i++) { /* a member itself */      \
            if (value == (table)[i]) {                                              \
                self->field = (uint8_t)i;                                           \
                return 0;                                                           \
            }                                                                       \
        }                                                                           \
        long long v;                                                                \
        if (as_bounded(value, #field, 0, (n) - 1, &v) < 0) {                        \
            return -1;                                                              \
        }                                                                           \
        self->field = (uint8_t)v;                                                   \
        return 0;                                                                   \
    }

ENUM_FIELD(state, states, NUM_STATES)
ENUM_FIELD(storage, storage_states, NUM_STORAGE)

/* -- TreeNode --------------------------------------------------------------- */

static int
is_digest(PyObject *key)
{
    return PyBytes_CheckExact(key) && PyBytes_GET_SIZE(key) == DIGEST_SIZE;
}

/* Stores a new node's key: inline when it is a digest, else a new reference. */
static void
node_set_key(TreeNodeObject *node, PyObject *key)
{
    if (is_digest(key)) {
        memcpy(node->key.digest, PyBytes_AS_STRING(key), DIGEST_SIZE);
        node->inline_key = 1;
    }
    else {
        Py_INCREF(key);
        node->key.ref.obj = key;
        node->key.ref.hash = 0;
        node->inline_key = 0;
    }
}

/* The node's key as an object (a new reference; a new bytes for an inline key). */
static PyObject *
node_key(TreeNodeObject *node)
{
    if (node->inline_key) {
        return PyBytes_FromStringAndSize((const char *)node->key.digest, DIGEST_SIZE);
    }
    Py_INCREF(node->key.ref.obj);
    return node->key.ref.obj;
}

/* The hash of a digest's 32 bytes: each 64-bit word times its own odd constant
 * (a bijection: keys that differ in one word never collide before the fold),
 * the products xored, then folded and mixed so that every input bit reaches the
 * low bits a bucket is picked by. Four independent multiplies and a short
 * finalizer: about 15 instructions where the bytes hash (SipHash) takes a
 * hundred and more; the index computes it on every lookup, eviction and grow. */
_Static_assert(DIGEST_SIZE == 4 * sizeof(uint64_t), "a digest is four 64-bit words");

static inline Py_hash_t
digest_hash(const void *digest)
{
    const unsigned char *p = digest;
    uint64_t w[4];
    memcpy(w, p, sizeof w);
    uint64_t h = (w[0] * 0x9E3779B97F4A7C15ULL) ^ (w[1] * 0xBF58476D1CE4E5B9ULL) ^
                 (w[2] * 0x94D049BB133111EBULL) ^ (w[3] * 0xD6E8FEB86659FD93ULL);
    h ^= h >> 32;
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 29;
    return (Py_hash_t)h == -1 ? -2 : (Py_hash_t)h;
}

/* The hash a key is indexed under: digest_hash for any bytes of DIGEST_SIZE
 * (subclasses too, so that keys equal as bytes share a bucket), else hash(key). */
static Py_hash_t
key_hash(PyObject *key)
{
    if (PyBytes_Check(key) && PyBytes_GET_SIZE(key) == DIGEST_SIZE) {
        return digest_hash(PyBytes_AS_STRING(key));
    }
    return PyObject_Hash(key);
}

/* The hash the node is indexed under. */
static Py_hash_t
node_hash(TreeNodeObject *node)
{
    if (node->inline_key) {
        return digest_hash(node->key.digest);
    }
    return node->key.ref.hash;
}

static int
check_parent(PyObject *parent)
{
    if (parent != Py_None && !TreeNode_Check(parent)) {
        PyErr_Format(PyExc_TypeError, "TreeNode.parent: must be a TreeNode or None, got %.100s",
                     Py_TYPE(parent)->tp_name);
        return -1;
    }
    return 0;
}

static PyObject *
node_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"key", "parent", "device_block", "num_children", NULL};
    PyObject *key, *parent, *device_block, *num_children = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|O:TreeNode", kwlist, &key, &parent,
                                     &device_block, &num_children)) {
        return NULL;
    }
    if (check_parent(parent) < 0) {
        return NULL;
    }
    long long dev, children = 0;
    if (as_bounded(device_block, "device_block", -1, INT32_MAX, &dev) < 0) {
        return NULL;
    }
    if (num_children != NULL &&
        as_bounded(num_children, "num_children", 0, INT32_MAX, &children) < 0) {
        return NULL;
    }
    TreeNodeObject *self = node_alloc();
    if (self == NULL) {
        return NULL;
    }
    node_set_key(self, key);
    Py_INCREF(parent);
    self->parent = parent;
    for (int s = 0; s < NUM_SLOTS; s++) {
        self->prev[s] = self->next[s] = 0;
        self->owner[s] = 0;
    }
    self->hnext = NULL;
    self->indexed = 0;
    self->hits = 0;
    self->device_block = (int32_t)dev;
    self->host_block = -1;
    self->ref = 1; /* a new node starts locked by the request that computed it */
    self->num_children = (int32_t)children;
    /* Children whose device block stays: any state but HOST and SWAP_TO_HOST. */
    self->num_device_children = (int32_t)children;
    self->state = 0; /* DEVICE */
    self->storage = 0; /* NOT_STORED */
    return (PyObject *)self;
}

/* Frees a node and, without recursion, every ancestor whose last reference it
 * held: a deep path would otherwise dealloc through one C frame per level. */
static void
node_dealloc(TreeNodeObject *self)
{
    while (self != NULL) {
        PyObject *parent = self->parent;
        if (!self->inline_key) {
            Py_XDECREF(self->key.ref.obj);
        }
        node_free(self);
        self = NULL;
        if (parent == NULL) {
            break;
        }
        if (TreeNode_Check(parent) && Py_REFCNT(parent) == 1) {
            Py_SET_REFCNT(parent, 0);
            self = (TreeNodeObject *)parent;
        }
        else {
            Py_DECREF(parent);
        }
    }
}

static PyObject *
node_repr(TreeNodeObject *self)
{
    PyObject *state = node_get_state(self, NULL);
    if (state == NULL) {
        return NULL;
    }
    PyObject *name = PyObject_GetAttrString(state, "name");
    Py_DECREF(state);
    if (name == NULL) {
        PyErr_Clear();
        name = PyUnicode_FromFormat("%d", (int)self->state);
        if (name == NULL) {
            return NULL;
        }
    }
    PyObject *key = node_key(self);
    if (key == NULL) {
        Py_DECREF(name);
        return NULL;
    }
    PyObject *r = PyUnicode_FromFormat("TreeNode(%R, %U, dev=%d, host=%d, ref=%d)", key,
                                       name, (int)self->device_block, (int)self->host_block,
                                       (int)self->ref);
    Py_DECREF(key);
    Py_DECREF(name);
    return r;
}

static PyObject *
node_get_key(TreeNodeObject *self, void *closure)
{
    return node_key(self);
}

static PyObject *
node_get_parent(TreeNodeObject *self, void *closure)
{
    Py_INCREF(self->parent);
    return self->parent;
}

#define GETSET(field, doc) \
    {#field, (getter)node_get_##field, (setter)node_set_##field, doc, NULL}

static PyGetSetDef node_getset[] = {
    {"key", (getter)node_get_key, NULL, "The block hash (read-only).", NULL},
    {"parent", (getter)node_get_parent, NULL, "The parent node, None for the root (read-only).",
     NULL},
    GETSET(state, "The NodeState member: where the block lives."),
    GETSET(device_block, "Device block id, -1 for none (int32)."),
    GETSET(host_block, "Host block id, -1 for none (int32)."),
    GETSET(ref, "Requests holding the node (>= 0, int32)."),
    GETSET(num_children, "Children in the tree (>= 0, int32)."),
    GETSET(num_device_children, "Children that keep a device block (>= 0, int32)."),
    GETSET(hits, "Matches so far (>= 0; takes an int64, keeps at most 2**32 - 1)."),
    GETSET(storage, "The StorageState member: where the block stands with the storage tier."),
    {NULL},
};

static PyTypeObject TreeNodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fastkv.scheduler._tree_node.TreeNode",
    .tp_doc = PyDoc_STR("TreeNode(key, parent, device_block, num_children=0)\n\n"
                        "One cached block (C fields; not tracked by the cyclic garbage "
                        "collector: a node refers only to its key and its parent)."),
    .tp_basicsize = sizeof(TreeNodeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = node_new,
    .tp_dealloc = (destructor)node_dealloc,
    .tp_repr = (reprfunc)node_repr,
    .tp_getset = node_getset,
};

/* -- LRUList --------------------------------------------------------------- */

static TreeNodeObject *
as_node(PyObject *obj)
{
    if (!TreeNode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "LRUList: keys must be TreeNodes, got %.100s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return (TreeNodeObject *)obj;
}

/* Links an unlisted node at the tail (newest) or head (oldest); takes a reference. */
static inline __attribute__((always_inline)) void
link_node(LRUListObject *self, TreeNodeObject *node, int at_tail)
{
    int s = self->slot;
    uint32_t id = node_id(node);
    Py_INCREF(node);
    node->owner[s] = self->id;
    if (at_tail) {
        node->prev[s] = self->tail_id;
        node->next[s] = 0;
        if (self->tail != NULL) {
            self->tail->next[s] = id;
        }
        else {
            self->head = node;
            self->head_id = id;
        }
        self->tail = node;
        self->tail_id = id;
    }
    else {
        node->next[s] = self->head_id;
        node->prev[s] = 0;
        if (self->head != NULL) {
            self->head->prev[s] = id;
        }
        else {
            self->tail = node;
            self->tail_id = id;
        }
        self->head = node;
        self->head_id = id;
    }
    self->size++;
    self->version++;
}

/* Unlinks a node this list holds; returns the list's reference to the caller. */
static inline __attribute__((always_inline)) TreeNodeObject *
unlink_node(LRUListObject *self, TreeNodeObject *node)
{
    int s = self->slot;
    uint32_t prev_id = node->prev[s], next_id = node->next[s];
    TreeNodeObject *prev = node_at(prev_id), *next = node_at(next_id);
    if (prev != NULL) {
        prev->next[s] = next_id;
    }
    else {
        self->head = next;
        self->head_id = next_id;
    }
    if (next != NULL) {
        next->prev[s] = prev_id;
    }
    else {
        self->tail = prev;
        self->tail_id = prev_id;
    }
    node->prev[s] = node->next[s] = 0;
    node->owner[s] = 0;
    self->size--;
    self->version++;
    return node;
}

static PyObject *
lru_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"slot", NULL};
    int slot;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i:LRUList", kwlist, &slot)) {
        return NULL;
    }
    if (slot < 0 || slot >= NUM_SLOTS) {
        PyErr_Format(PyExc_ValueError, "LRUList.slot: %d is out of range [0, %d]", slot,
                     NUM_SLOTS - 1);
        return NULL;
    }
    int id = 1;
    while (id <= MAX_LISTS && lists_by_id[id] != NULL) {
        id++;
    }
    if (id > MAX_LISTS) {
        PyErr_Format(PyExc_RuntimeError, "LRUList: %d lists exist, the most at once", MAX_LISTS);
        return NULL;
    }
    LRUListObject *self = PyObject_New(LRUListObject, type);
    if (self == NULL) {
        return NULL;
    }
    self->id = (uint8_t)id;
    lists_by_id[id] = self;
    self->head = self->tail = NULL;
    self->head_id = self->tail_id = 0;
    self->size = 0;
    self->version = 0;
    self->slot = slot;
    return (PyObject *)self;
}

static void
lru_clear_all(LRUListObject *self)
{
    while (self->head != NULL) {
        Py_DECREF(unlink_node(self, self->head));
    }
}

static void
lru_dealloc(LRUListObject *self)
{
    lru_clear_all(self);
    lists_by_id[self->id] = NULL;
    PyObject_Free(self);
}

static Py_ssize_t
lru_len(LRUListObject *self)
{
    return self->size;
}

static int
lru_contains(LRUListObject *self, PyObject *key)
{
    return TreeNode_Check(key) && ((TreeNodeObject *)key)->owner[self->slot] == self->id;
}

/* Raises when `node` is on another list of this slot. */
static int
check_free(LRUListObject *self, TreeNodeObject *node)
{
    uint8_t owner = node->owner[self->slot];
    if (owner != 0 && owner != self->id) {
        PyErr_SetString(PyExc_ValueError, "LRUList: the node is on another list of this slot");
        return -1;
    }
    return 0;
}

/* lru[node] = None appends an unlisted node (a listed one keeps its place);
 * del lru[node] unlinks it (KeyError when it is not listed). */
static int
lru_ass_sub(LRUListObject *self, PyObject *key, PyObject *value)
{
    TreeNodeObject *node = as_node(key);
    if (node == NULL) {
        return -1;
    }
    if (value == NULL) {
        if (node->owner[self->slot] != self->id) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        Py_DECREF(unlink_node(self, node));
        return 0;
    }
    if (value != Py_None) {
        PyErr_SetString(PyExc_TypeError, "LRUList: the only value is None");
        return -1;
    }
    if (check_free(self, node) < 0) {
        return -1;
    }
    if (node->owner[self->slot] != self->id) {
        link_node(self, node, 1);
    }
    return 0;
}

static PyObject *
lru_subscript(LRUListObject *self, PyObject *key)
{
    if (!lru_contains(self, key)) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
lru_pop(LRUListObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "LRUList.pop: takes 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *key = args[0];
    if (lru_contains(self, key)) {
        Py_DECREF(unlink_node(self, (TreeNodeObject *)key));
        Py_RETURN_NONE;
    }
    if (nargs == 2) {
        Py_INCREF(args[1]);
        return args[1];
    }
    PyErr_SetObject(PyExc_KeyError, key);
    return NULL;
}

static int
parse_last(const char *what, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
           Py_ssize_t positional_before, int *last)
{
    PyObject *arg = NULL;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs > positional_before + 1 || nargs + nkw > positional_before + 1) {
        PyErr_Format(PyExc_TypeError, "LRUList.%s: too many arguments", what);
        return -1;
    }
    if (nkw == 1) {
        if (!PyUnicode_Check(PyTuple_GET_ITEM(kwnames, 0)) ||
            PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "last") != 0) {
            PyErr_Format(PyExc_TypeError, "LRUList.%s: unexpected keyword %R", what,
                         PyTuple_GET_ITEM(kwnames, 0));
            return -1;
        }
        arg = args[nargs];
    }
    else if (nargs == positional_before + 1) {
        arg = args[positional_before];
    }
    *last = 1;
    if (arg != NULL) {
        int t = PyObject_IsTrue(arg);
        if (t < 0) {
            return -1;
        }
        *last = t;
    }
    return 0;
}

static PyObject *
lru_move_to_end(LRUListObject *self, PyObject *const *args, Py_ssize_t nargs,
                PyObject *kwnames)
{
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "LRUList.move_to_end: missing the node");
        return NULL;
    }
    int last;
    if (parse_last("move_to_end", args, nargs, kwnames, 1, &last) < 0) {
        return NULL;
    }
    if (!lru_contains(self, args[0])) {
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    TreeNodeObject *node = unlink_node(self, (TreeNodeObject *)args[0]);
    link_node(self, node, last);
    Py_DECREF(node); /* link_node took its own reference */
    Py_RETURN_NONE;
}

static PyObject *
lru_popitem(LRUListObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    int last;
    if (parse_last("popitem", args, nargs, kwnames, 0, &last) < 0) {
        return NULL;
    }
    if (self->head == NULL) {
        PyErr_SetString(PyExc_KeyError, "LRUList.popitem: the list is empty");
        return NULL;
    }
    TreeNodeObject *node = unlink_node(self, last ? self->tail : self->head);
    PyObject *item = PyTuple_Pack(2, (PyObject *)node, Py_None);
    Py_DECREF(node);
    return item;
}

static PyObject *
lru_pop_oldest(LRUListObject *self, PyObject *unused)
{
    if (self->head == NULL) {
        Py_RETURN_NONE;
    }
    return (PyObject *)unlink_node(self, self->head);
}

static PyObject *lru_iter(LRUListObject *self);

static PyMethodDef lru_methods[] = {
    {"pop", (PyCFunction)(void (*)(void))lru_pop, METH_FASTCALL,
     "pop(node[, default]): unlink a listed node (returns None), else default or KeyError."},
    {"move_to_end", (PyCFunction)(void (*)(void))lru_move_to_end,
     METH_FASTCALL | METH_KEYWORDS,
     "move_to_end(node, last=True): move a listed node to the newest (or oldest) end."},
    {"popitem", (PyCFunction)(void (*)(void))lru_popitem, METH_FASTCALL | METH_KEYWORDS,
     "popitem(last=True): unlink the newest (or oldest) node; returns (node, None)."},
    {"pop_oldest", (PyCFunction)lru_pop_oldest, METH_NOARGS,
     "pop_oldest(): unlink and return the oldest node, or None when empty."},
    {NULL},
};

static PySequenceMethods lru_as_sequence = {
    .sq_length = (lenfunc)lru_len,
    .sq_contains = (objobjproc)lru_contains,
};

static PyMappingMethods lru_as_mapping = {
    .mp_length = (lenfunc)lru_len,
    .mp_subscript = (binaryfunc)lru_subscript,
    .mp_ass_subscript = (objobjargproc)lru_ass_sub,
};

static PyTypeObject LRUListType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fastkv.scheduler._tree_node.LRUList",
    .tp_doc = PyDoc_STR("LRUList(slot)\n\nAn eviction list of TreeNodes, oldest first, linked "
                        "through the nodes' `slot` link pair (0 or 1). The OrderedDict "
                        "subset the radix tree uses, with the same semantics."),
    .tp_basicsize = sizeof(LRUListObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = lru_new,
    .tp_dealloc = (destructor)lru_dealloc,
    .tp_as_sequence = &lru_as_sequence,
    .tp_as_mapping = &lru_as_mapping,
    .tp_iter = (getiterfunc)lru_iter,
    .tp_methods = lru_methods,
};

/* -- iteration (oldest first; changing the list while iterating raises) ----- */

typedef struct {
    PyObject_HEAD
    LRUListObject *list;
    TreeNodeObject *next; /* strong reference, or NULL at the end */
    uint64_t version;
} LRUIterObject;

static PyObject *
lru_iter(LRUListObject *self)
{
    LRUIterObject *it = PyObject_New(LRUIterObject, &LRUIterType);
    if (it == NULL) {
        return NULL;
    }
    Py_INCREF(self);
    it->list = self;
    it->next = self->head;
    Py_XINCREF(it->next);
    it->version = self->version;
    return (PyObject *)it;
}

static void
lru_iter_dealloc(LRUIterObject *it)
{
    Py_XDECREF(it->next);
    Py_DECREF(it->list);
    PyObject_Free(it);
}

static PyObject *
lru_iter_next(LRUIterObject *it)
{
    if (it->next == NULL) {
        return NULL;
    }
    if (it->version != it->list->version) {
        PyErr_SetString(PyExc_RuntimeError, "LRUList changed during iteration");
        return NULL;
    }
    TreeNodeObject *node = it->next; /* the reference passes to the caller */
    it->next = node_at(node->next[it->list->slot]);
    Py_XINCREF(it->next);
    return (PyObject *)node;
}

static PyTypeObject LRUIterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fastkv.scheduler._tree_node.LRUListIterator",
    .tp_basicsize = sizeof(LRUIterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)lru_iter_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)lru_iter_next,
};


/* -- NodeIndex ------------------------------------------------------------------
 *
 * The tree-wide map from key to node: a chained hash table threaded through the
 * nodes (`hnext`, `hash`). It grows by doubling, incrementally: while a grow is
 * under way, every operation moves a few buckets from the old array to the new
 * one, so no single call rehashes millions of entries (a dict's resize at 4M keys
 * stalls its caller for hundreds of milliseconds). It never shrinks. It holds a
 * strong reference to each node it indexes.
 *
 * While it grows, a key lives in exactly one array: the old one while its old
 * bucket has not been moved yet (`index_table_of`), the new one after. So every
 * lookup reads one bucket, and the new array is written only where the move has
 * reached (old bucket i goes to new buckets i and i + old size), front to back:
 * its pages are touched in order, a few per call, where keys added anywhere in it
 * faulted in a page per key (about 250 page faults per 128-block request, 0.9 ms
 * of a request's CPU time, at the start of the grow from 2M to 4M buckets).
 */

#define INDEX_MIN_BUCKETS 8
#define REHASH_STEP 4

typedef struct {
    PyObject_HEAD
    TreeNodeObject **table[2]; /* [0] the current array; [1] the old one while growing */
    size_t mask[2];
    size_t rehash_idx; /* next bucket of table[1] to move; meaningful while table[1] */
    size_t released;   /* bytes of table[1], from its first page boundary, given back */
    Py_ssize_t size;
    Py_ssize_t num_ref_keys; /* nodes whose key is held by reference (not a digest) */
    uint64_t version;
} NodeIndexObject;

static PyTypeObject NodeIndexType;

#define RELEASE_CHUNK (64 * 1024)

/* Gives the pages of the old array that the grow has emptied back to the system
 * as it goes (they read as zeros, i.e. empty buckets, if touched again): freeing
 * a touched array of millions of buckets at once costs its caller milliseconds
 * (1.6 ms for 16 MiB), the last step of a grow included. Only whole pages inside
 * the array are released. */
static void
index_release_moved(NodeIndexObject *self)
{
#ifdef MADV_DONTNEED
    static uintptr_t page = 0;
    if (page == 0) {
        long size = sysconf(_SC_PAGESIZE);
        page = size > 0 ? (uintptr_t)size : 4096;
    }
    uintptr_t start = (uintptr_t)self->table[1];
    uintptr_t first = (start + page - 1) & ~(page - 1);
    uintptr_t done = (start + self->rehash_idx * sizeof(TreeNodeObject *)) & ~(page - 1);
    uintptr_t from = first + self->released;
    if (done >= from + RELEASE_CHUNK) {
        if (madvise((void *)from, done - from, MADV_DONTNEED) == 0) {
            self->released = done - first;
        }
    }
#endif
}

static void
index_rehash_step(NodeIndexObject *self, int buckets)
{
    TreeNodeObject **old = self->table[1];
    if (old == NULL) {
        return;
    }
    size_t n = self->mask[1] + 1;
    int empty_visits = buckets * 10;
    while (buckets > 0 && self->rehash_idx < n) {
        TreeNodeObject *node = old[self->rehash_idx];
        if (node == NULL) {
            self->rehash_idx++;
            if (--empty_visits == 0) {
                break;
            }
            continue;
        }
        while (node != NULL) {
            TreeNodeObject *next = node->hnext;
            size_t b = (size_t)node_hash(node) & self->mask[0];
            node->hnext = self->table[0][b];
            self->table[0][b] = node;
            node = next;
        }
        old[self->rehash_idx++] = NULL;
        buckets--;
    }
    if (self->rehash_idx >= n) {
        PyMem_Free(old);
        self->table[1] = NULL;
        self->mask[1] = 0;
        self->rehash_idx = 0;
        self->released = 0;
    }
    else {
        index_release_moved(self);
    }
}

/* Which array holds (or would hold) a key of hash h: 1, the old one, while a grow
 * has not moved its old bucket yet; else 0. */
static inline int
index_table_of(const NodeIndexObject *self, Py_hash_t h)
{
    return self->table[1] != NULL && ((size_t)h & self->mask[1]) >= self->rehash_idx;
}

/* Makes room for one more node: starts a grow when the load reaches 1. */
static int
index_reserve(NodeIndexObject *self)
{
    index_rehash_step(self, REHASH_STEP);
    if ((size_t)self->size < self->mask[0] + 1) {
        return 0;
    }
    while (self->table[1] != NULL) { /* only if a grow could not keep up */
        index_rehash_step(self, 1 << 20);
    }
    size_t n = (self->mask[0] + 1) * 2;
    TreeNodeObject **bigger = PyMem_Calloc(n, sizeof(TreeNodeObject *));
    if (bigger == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->table[1] = self->table[0];
    self->mask[1] = self->mask[0];
    self->rehash_idx = 0;
    self->released = 0;
    self->table[0] = bigger;
    self->mask[0] = n - 1;
    self->version++;
    index_rehash_step(self, REHASH_STEP);
    return 0;
}

static int
keys_equal(PyObject *a, PyObject *b)
{
    if (a == b) {
        return 1;
    }
    PyTypeObject *t = Py_TYPE(a);
    if (t != Py_TYPE(b)) {
        return -2;
    }
    if (t == &PyBytes_Type) {
        return PyBytes_GET_SIZE(a) == PyBytes_GET_SIZE(b) &&
               memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), PyBytes_GET_SIZE(a)) == 0;
    }
    if (t == &PyLong_Type || t == &PyUnicode_Type) {
        return PyObject_RichCompareBool(a, b, Py_EQ); /* runs no Python code */
    }
    return -2; /* may run Python code: the caller re-checks the table */
}

/* The node indexed under `key` (borrowed), or NULL (with an error set on failure).
 * Where *pprev is given, it receives the link that points at the node. */
static TreeNodeObject *
index_find(NodeIndexObject *self, PyObject *key, Py_hash_t h, TreeNodeObject ***pprev)
{
    const void *digest = is_digest(key) ? PyBytes_AS_STRING(key) : NULL;
restart:
    {
        int t = index_table_of(self, h);
        TreeNodeObject **link = &self->table[t][(size_t)h & self->mask[t]];
        for (TreeNodeObject *node = *link; node != NULL; link = &node->hnext, node = *link) {
            int eq;
            if (node->inline_key && digest != NULL) { /* the common case */
                eq = memcmp(node->key.digest, digest, DIGEST_SIZE) == 0;
            }
            else if (node_hash(node) != h) {
                continue;
            }
            else if (!node->inline_key) {
                eq = keys_equal(node->key.ref.obj, key);
            }
            else {
                eq = -2; /* a digest against some other key: compare as objects */
            }
            if (eq == -2) { /* an arbitrary __eq__ may change the index */
                uint64_t version = self->version;
                Py_INCREF(node);
                PyObject *nkey = node_key(node);
                eq = nkey == NULL ? -1 : PyObject_RichCompareBool(nkey, key, Py_EQ);
                Py_XDECREF(nkey);
                Py_DECREF(node);
                if (eq >= 0 && version != self->version) {
                    goto restart;
                }
            }
            if (eq < 0) {
                return NULL;
            }
            if (eq) {
                if (pprev != NULL) {
                    *pprev = link;
                }
                return node;
            }
        }
    }
    return NULL;
}

/* index_find for a digest when every indexed key is a digest held inline
 * (num_ref_keys == 0): no other key can equal it, so bytes comparisons alone
 * decide, and nothing can fail. */
static inline TreeNodeObject *
index_find_digest(NodeIndexObject *self, const unsigned char *digest, Py_hash_t h)
{
    int t = index_table_of(self, h);
    for (TreeNodeObject *node = self->table[t][(size_t)h & self->mask[t]]; node != NULL;
         node = node->hnext) {
        if (memcmp(node->key.digest, digest, DIGEST_SIZE) == 0) {
            return node;
        }
    }
    return NULL;
}

/* Indexes `node` under its key (`key`: that key as an object, or NULL to make
 * one); raises ValueError if that key is indexed. */
static int
index_add(NodeIndexObject *self, TreeNodeObject *node, PyObject *key)
{
    if (node->indexed) {
        PyErr_SetString(PyExc_ValueError, "NodeIndex: the node is indexed already");
        return -1;
    }
    PyObject *made = NULL;
    if (key == NULL) {
        key = made = node_key(node);
        if (key == NULL) {
            return -1;
        }
    }
    Py_hash_t h = key_hash(key);
    if (h == -1) {
        Py_XDECREF(made);
        return -1;
    }
    if (index_find(self, key, h, NULL) != NULL) {
        PyErr_Format(PyExc_ValueError, "NodeIndex: key %R is indexed already", key);
        Py_XDECREF(made);
        return -1;
    }
    Py_XDECREF(made);
    if (PyErr_Occurred() || index_reserve(self) < 0) {
        return -1;
    }
    int t = index_table_of(self, h);
    size_t b = (size_t)h & self->mask[t];
    if (!node->inline_key) {
        node->key.ref.hash = h;
    }
    node->hnext = self->table[t][b];
    self->table[t][b] = node;
    node->indexed = 1;
    Py_INCREF(node);
    self->size++;
    self->num_ref_keys += !node->inline_key;
    self->version++;
    return 0;
}

/* Takes `node`, which `*link` points at, out of its bucket; returns the index's
 * reference. */
static TreeNodeObject *
index_detach(NodeIndexObject *self, TreeNodeObject **link, TreeNodeObject *node)
{
    *link = node->hnext;
    node->hnext = NULL;
    node->indexed = 0;
    self->size--;
    self->num_ref_keys -= !node->inline_key;
    self->version++;
    return node;
}

/* Unindexes the node under `key`; returns the index's reference, or NULL (KeyError
 * when absent). */
static TreeNodeObject *
index_pop(NodeIndexObject *self, PyObject *key)
{
    Py_hash_t h = key_hash(key);
    if (h == -1) {
        return NULL;
    }
    index_rehash_step(self, REHASH_STEP);
    TreeNodeObject **link;
    TreeNodeObject *node = index_find(self, key, h, &link);
    if (node == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, key);
        }
        return NULL;
    }
    return index_detach(self, link, node);
}

/* Unindexes `node` itself (no key comparison); returns the index's reference. */
static TreeNodeObject *
index_unlink(NodeIndexObject *self, TreeNodeObject *node)
{
    index_rehash_step(self, REHASH_STEP);
    Py_hash_t h = node_hash(node);
    int t = index_table_of(self, h);
    for (TreeNodeObject **link = &self->table[t][(size_t)h & self->mask[t]]; *link != NULL;
         link = &(*link)->hnext) {
        if (*link == node) {
            return index_detach(self, link, node);
        }
    }
    PyErr_SetString(PyExc_KeyError, "NodeIndex: the node is not indexed here");
    return NULL;
}

static PyObject *
nodeindex_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (!_PyArg_NoKeywords("NodeIndex", kwds) || !_PyArg_NoPositional("NodeIndex", args)) {
        return NULL;
    }
    NodeIndexObject *self = PyObject_New(NodeIndexObject, type);
    if (self == NULL) {
        return NULL;
    }
    self->table[0] = PyMem_Calloc(INDEX_MIN_BUCKETS, sizeof(TreeNodeObject *));
    if (self->table[0] == NULL) {
        PyObject_Free(self);
        return PyErr_NoMemory();
    }
    self->mask[0] = INDEX_MIN_BUCKETS - 1;
    self->table[1] = NULL;
    self->mask[1] = 0;
    self->rehash_idx = 0;
    self->released = 0;
    self->size = 0;
    self->num_ref_keys = 0;
    self->version = 0;
    return (PyObject *)self;
}

static void
nodeindex_dealloc(NodeIndexObject *self)
{
    for (int t = 0; t < 2; t++) {
        TreeNodeObject **table = self->table[t];
        if (table == NULL) {
            continue;
        }
        for (size_t b = 0; b <= self->mask[t]; b++) {
            TreeNodeObject *node = table[b];
            while (node != NULL) {
                TreeNodeObject *next = node->hnext;
                node->hnext = NULL;
                node->indexed = 0;
                Py_DECREF(node);
                node = next;
            }
        }
        PyMem_Free(table);
    }
    PyObject_Free(self);
}

static Py_ssize_t
nodeindex_len(NodeIndexObject *self)
{
    return self->size;
}

static TreeNodeObject *
nodeindex_lookup(NodeIndexObject *self, PyObject *key)
{
    Py_hash_t h = key_hash(key);
    if (h == -1) {
        return NULL;
    }
    return index_find(self, key, h, NULL);
}

static int
nodeindex_contains(NodeIndexObject *self, PyObject *key)
{
    TreeNodeObject *node = nodeindex_lookup(self, key);
    return node != NULL ? 1 : (PyErr_Occurred() ? -1 : 0);
}

static PyObject *
nodeindex_subscript(NodeIndexObject *self, PyObject *key)
{
    TreeNodeObject *node = nodeindex_lookup(self, key);
    if (node == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, key);
        }
        return NULL;
    }
    Py_INCREF(node);
    return (PyObject *)node;
}

/* index[key] = node indexes a node whose key equals `key` (no key may be replaced);
 * del index[key] unindexes. */
static int
nodeindex_ass_sub(NodeIndexObject *self, PyObject *key, PyObject *value)
{
    if (value == NULL) {
        TreeNodeObject *node = index_pop(self, key);
        if (node == NULL) {
            return -1;
        }
        Py_DECREF(node);
        return 0;
    }
    TreeNodeObject *node = as_node(value);
    if (node == NULL) {
        return -1;
    }
    PyObject *nkey = node_key(node);
    if (nkey == NULL) {
        return -1;
    }
    int eq = nkey == key ? 1 : PyObject_RichCompareBool(nkey, key, Py_EQ);
    if (eq <= 0) {
        if (eq == 0) {
            PyErr_Format(PyExc_ValueError, "NodeIndex: key %R is not the node's key %R", key,
                         nkey);
        }
        Py_DECREF(nkey);
        return -1;
    }
    Py_DECREF(nkey);
    return index_add(self, node, key);
}

static PyObject *
nodeindex_get(NodeIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "NodeIndex.get: takes 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    TreeNodeObject *node = nodeindex_lookup(self, args[0]);
    if (node != NULL) {
        Py_INCREF(node);
        return (PyObject *)node;
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    PyObject *dflt = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(dflt);
    return dflt;
}

static PyObject *
nodeindex_isdisjoint(NodeIndexObject *self, PyObject *keys)
{
    PyObject *it = PyObject_GetIter(keys);
    if (it == NULL) {
        return NULL;
    }
    PyObject *key;
    while ((key = PyIter_Next(it)) != NULL) {
        int found = nodeindex_contains(self, key);
        Py_DECREF(key);
        if (found != 0) {
            Py_DECREF(it);
            if (found < 0) {
                return NULL;
            }
            Py_RETURN_FALSE;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_TRUE;
}

/* A list snapshot of the nodes (`pairs`: of (key, node) tuples). */
static PyObject *
nodeindex_snapshot(NodeIndexObject *self, int pairs)
{
    PyObject *out = PyList_New(self->size);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t i = 0;
    for (int t = 0; t < 2; t++) {
        TreeNodeObject **table = self->table[t];
        if (table == NULL) {
            continue;
        }
        for (size_t b = 0; b <= self->mask[t]; b++) {
            for (TreeNodeObject *node = table[b]; node != NULL; node = node->hnext) {
                PyObject *item;
                if (pairs) {
                    PyObject *key = node_key(node);
                    item = key == NULL ? NULL : PyTuple_Pack(2, key, (PyObject *)node);
                    Py_XDECREF(key);
                    if (item == NULL) {
                        Py_DECREF(out);
                        return NULL;
                    }
                }
                else {
                    Py_INCREF(node);
                    item = (PyObject *)node;
                }
                PyList_SET_ITEM(out, i++, item);
            }
        }
    }
    return out;
}

static PyObject *
nodeindex_values(NodeIndexObject *self, PyObject *unused)
{
    return nodeindex_snapshot(self, 0);
}

static PyObject *
nodeindex_items(NodeIndexObject *self, PyObject *unused)
{
    return nodeindex_snapshot(self, 1);
}

static PyObject *
nodeindex_add(NodeIndexObject *self, PyObject *arg)
{
    TreeNodeObject *node = as_node(arg);
    if (node == NULL || index_add(self, node, NULL) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* _array_of(key): 0 or 1, the array holding `key`'s node (1: the old one, while a
 * grow has not reached its bucket), or None when it is not indexed. For tests. */
static PyObject *
nodeindex_array_of(NodeIndexObject *self, PyObject *key)
{
    Py_hash_t h = key_hash(key);
    if (h == -1) {
        return NULL;
    }
    TreeNodeObject *node = index_find(self, key, h, NULL);
    if (node == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    for (int t = 0; t < 2; t++) { /* where it is, not where index_table_of says */
        if (self->table[t] == NULL) {
            continue;
        }
        for (TreeNodeObject *n = self->table[t][(size_t)h & self->mask[t]]; n != NULL;
             n = n->hnext) {
            if (n == node) {
                return PyLong_FromLong(t);
            }
        }
    }
    PyErr_SetString(PyExc_AssertionError, "NodeIndex: a node found is in neither array");
    return NULL;
}

static PyObject *
nodeindex_growing(NodeIndexObject *self, PyObject *unused)
{
    return PyBool_FromLong(self->table[1] != NULL);
}

static PyMethodDef nodeindex_methods[] = {
    {"get", (PyCFunction)(void (*)(void))nodeindex_get, METH_FASTCALL,
     "get(key[, default]): the node indexed under key, else default (None)."},
    {"add", (PyCFunction)nodeindex_add, METH_O,
     "add(node): index a node under its key (ValueError if the key is indexed)."},
    {"isdisjoint", (PyCFunction)nodeindex_isdisjoint, METH_O,
     "isdisjoint(keys): True when no key of `keys` is indexed."},
    {"values", (PyCFunction)nodeindex_values, METH_NOARGS, "values(): a list of the nodes."},
    {"items", (PyCFunction)nodeindex_items, METH_NOARGS,
     "items(): a list of (key, node) pairs."},
    {"_array_of", (PyCFunction)nodeindex_array_of, METH_O,
     "_array_of(key): 0 or 1, the array holding key's node (1: the old one, while a "
     "grow has not moved its bucket yet), None if not indexed. For tests."},
    {"growing", (PyCFunction)nodeindex_growing, METH_NOARGS,
     "growing(): whether an incremental grow is under way (for tests)."},
    {NULL},
};

static PySequenceMethods nodeindex_as_sequence = {
    .sq_length = (lenfunc)nodeindex_len,
    .sq_contains = (objobjproc)nodeindex_contains,
};

static PyMappingMethods nodeindex_as_mapping = {
    .mp_length = (lenfunc)nodeindex_len,
    .mp_subscript = (binaryfunc)nodeindex_subscript,
    .mp_ass_subscript = (objobjargproc)nodeindex_ass_sub,
};

static PyTypeObject NodeIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fastkv.scheduler._tree_node.NodeIndex",
    .tp_doc = PyDoc_STR("NodeIndex()\n\nTreeNodes by key: a hash table threaded through the "
                        "nodes that grows incrementally (no call rehashes it whole)."),
    .tp_basicsize = sizeof(NodeIndexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = nodeindex_new,
    .tp_dealloc = (destructor)nodeindex_dealloc,
    .tp_as_sequence = &nodeindex_as_sequence,
    .tp_as_mapping = &nodeindex_as_mapping,
    .tp_methods = nodeindex_methods,
};

/* -- path operations (the radix tree's hot loops; radix_tree.py has the
 *    equivalent Python loops for builds without this extension) ------------ */

#define STATE_DEVICE 0
#define STATE_HOST 1

static LRUListObject *
as_lru(PyObject *obj, const char *name)
{
    if (!Py_IS_TYPE(obj, &LRUListType)) {
        PyErr_Format(PyExc_TypeError, "%s: must be an LRUList, got %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return (LRUListObject *)obj;
}

/* lru[node] = None: append an unlisted node, keep a listed one in place. */
static int
list_node(LRUListObject *lru, TreeNodeObject *node)
{
    if (node->owner[lru->slot] == lru->id) {
        return 0;
    }
    if (check_free(lru, node) < 0) {
        return -1;
    }
    link_node(lru, node, 1);
    return 0;
}

static PyObject *
unlock_path(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "unlock_path(nodes, device_lru, host_lru)");
        return NULL;
    }
    LRUListObject *device_lru = as_lru(args[1], "device_lru");
    LRUListObject *host_lru = as_lru(args[2], "host_lru");
    if (device_lru == NULL || host_lru == NULL) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "unlock_path: nodes must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = n - 1; i >= 0; i--) { /* deepest first */
        TreeNodeObject *node = as_node(items[i]);
        if (node == NULL) {
            goto error;
        }
        if (node->ref == 1) {
            node->ref = 0;
            if (node->state == STATE_DEVICE) {
                if (list_node(device_lru, node) < 0 ||
                    (node->host_block >= 0 && list_node(host_lru, node) < 0)) {
                    goto error;
                }
            }
            else if (node->state == STATE_HOST && list_node(host_lru, node) < 0) {
                goto error;
            }
        }
        else if (node->ref > 1) {
            node->ref--;
        }
        else {
            PyObject *r = node_repr(node);
            if (r != NULL) {
                PyErr_Format(PyExc_AssertionError, "unlocking %U, which is not locked", r);
                Py_DECREF(r);
            }
            goto error;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
error:
    Py_DECREF(seq);
    return NULL;
}

static PyObject *
discard_leaves(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "discard_leaves(lru, parked, index, n)");
        return NULL;
    }
    LRUListObject *lru = as_lru(args[0], "lru");
    if (lru == NULL) {
        return NULL;
    }
    PyObject *parked = args[1];
    if (!PySet_Check(parked) || !Py_IS_TYPE(args[2], &NodeIndexType)) {
        PyErr_SetString(PyExc_TypeError,
                        "discard_leaves: parked must be a set, index a NodeIndex");
        return NULL;
    }
    NodeIndexObject *index = (NodeIndexObject *)args[2];
    Py_ssize_t n = PyLong_AsSsize_t(args[3]);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *freed = PyList_New(0);
    if (freed == NULL) {
        return NULL;
    }
    int s = lru->slot;
    while (n > 0 && lru->head != NULL) {
        TreeNodeObject *node = unlink_node(lru, lru->head); /* the list's reference */
        if (node->num_children) { /* only after a failure reordered the list */
            int r = PySet_Add(parked, (PyObject *)node);
            Py_DECREF(node);
            if (r < 0) {
                goto error;
            }
            continue;
        }
        TreeNodeObject *parent = (TreeNodeObject *)node->parent;
        if (!TreeNode_Check((PyObject *)parent) || parent->num_children <= 0 ||
            parent->num_device_children <= 0) {
            PyErr_SetString(PyExc_AssertionError, "discard_leaves: a leaf's parent counts are off");
            Py_DECREF(node);
            goto error;
        }
        PyObject *block = PyLong_FromLong(node->device_block);
        TreeNodeObject *unindexed = block != NULL ? index_unlink(index, node) : NULL;
        if (unindexed == NULL) {
            Py_XDECREF(block);
            Py_DECREF(node);
            goto error;
        }
        Py_DECREF(unindexed); /* `node` still holds it */
        parent->num_children--;
        parent->num_device_children--;
        if (!parent->num_device_children) {
            int r = PySet_Discard(parked, (PyObject *)parent);
            if (r < 0) {
                Py_DECREF(block);
                Py_DECREF(node);
                goto error;
            }
            if (r == 1) { /* unpark: back to the head */
                if (parent->owner[s] == lru->id) {
                    Py_DECREF(unlink_node(lru, parent));
                }
                if (check_free(lru, parent) < 0) {
                    Py_DECREF(block);
                    Py_DECREF(node);
                    goto error;
                }
                link_node(lru, parent, 0);
            }
        }
        Py_DECREF(node);
        int r = PyList_Append(freed, block);
        Py_DECREF(block);
        if (r < 0) {
            goto error;
        }
        n--;
    }
    return freed;
error:
    Py_DECREF(freed);
    return NULL;
}

static PyObject *
make_path(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "make_path(parent, keys, device_blocks, index)");
        return NULL;
    }
    PyObject *parent = args[0];
    if (!TreeNode_Check(parent) || !Py_IS_TYPE(args[3], &NodeIndexType)) {
        PyErr_SetString(PyExc_TypeError,
                        "make_path: parent must be a TreeNode, index a NodeIndex");
        return NULL;
    }
    NodeIndexObject *index = (NodeIndexObject *)args[3];
    PyObject *keys = PySequence_Fast(args[1], "make_path: keys must be a sequence");
    if (keys == NULL) {
        return NULL;
    }
    /* The device blocks: an int32 buffer (a request's table, an array('i')) is read
     * as it is, any other sequence item by item; either way as int32 ids. */
    Py_buffer view = {0};
    PyObject *blocks = NULL;
    Py_ssize_t num_blocks = 0;
    int as_buffer = 0;
    if (PyObject_CheckBuffer(args[2])) {
        if (PyObject_GetBuffer(args[2], &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Clear(); /* read as a sequence below */
        }
        else if (view.itemsize == sizeof(int32_t) && view.format != NULL &&
                 strcmp(view.format, "i") == 0) {
            as_buffer = 1;
            num_blocks = view.len / (Py_ssize_t)sizeof(int32_t);
        }
        else {
            PyBuffer_Release(&view);
        }
    }
    if (!as_buffer) {
        blocks = PySequence_Fast(args[2], "make_path: device_blocks must be a sequence");
        if (blocks == NULL) {
            Py_DECREF(keys);
            return NULL;
        }
        num_blocks = PySequence_Fast_GET_SIZE(blocks);
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject *path = NULL;
    if (num_blocks < n) {
        PyErr_Format(PyExc_ValueError, "make_path: %zd keys but %zd device blocks", n,
                     num_blocks);
        goto done;
    }
    /* Validate every block id before creating anything. */
    long long ids_buf[64], *ids = ids_buf;
    if (n > 64) {
        ids = PyMem_Malloc(sizeof(long long) * n);
        if (ids == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    PyObject **kitems = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (blocks == NULL) {
            ids[i] = ((const int32_t *)view.buf)[i];
            if (ids[i] < -1) {
                PyErr_Format(PyExc_OverflowError,
                             "TreeNode.device_block: %lld is out of range [-1, %lld]", ids[i],
                             (long long)INT32_MAX);
                goto done_ids;
            }
        }
        else if (as_bounded(PySequence_Fast_GET_ITEM(blocks, i), "device_block", -1, INT32_MAX,
                            &ids[i]) < 0) {
            goto done_ids;
        }
    }
    path = PyList_New(n);
    if (path == NULL) {
        goto done_ids;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        TreeNodeObject *node = node_alloc();
        if (node == NULL) {
            Py_CLEAR(path);
            goto done_ids;
        }
        node_set_key(node, kitems[i]);
        Py_INCREF(parent);
        node->parent = parent;
        for (int s = 0; s < NUM_SLOTS; s++) {
            node->prev[s] = node->next[s] = 0;
            node->owner[s] = 0;
        }
        node->hnext = NULL;
        node->indexed = 0;
        node->hits = 0;
        node->device_block = (int32_t)ids[i];
        node->host_block = -1;
        node->ref = 1;
        node->num_children = node->num_device_children = i + 1 < n ? 1 : 0;
        node->state = STATE_DEVICE;
        node->storage = 0;
        PyList_SET_ITEM(path, i, (PyObject *)node);
        parent = (PyObject *)node;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (index_add(index, (TreeNodeObject *)PyList_GET_ITEM(path, i), kitems[i]) < 0) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            for (Py_ssize_t j = 0; j < i; j++) { /* leave the index as it was */
                Py_XDECREF(index_pop(index, kitems[j]));
            }
            PyErr_Restore(type, value, tb);
            Py_CLEAR(path);
            goto done_ids;
        }
    }
done_ids:
    if (ids != ids_buf) {
        PyMem_Free(ids);
    }
done:
    Py_DECREF(keys);
    if (blocks != NULL) {
        Py_DECREF(blocks);
    }
    else {
        PyBuffer_Release(&view);
    }
    return path;
}

/* Raises TypeError naming the first entry of `items` that is not a `bytes` of
 * exactly `size` bytes (`name` names the list). */
static int
check_digest_types(PyObject **items, Py_ssize_t n, PyObject *name, Py_ssize_t size)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = items[i];
        if (!PyBytes_CheckExact(h) || PyBytes_GET_SIZE(h) != size) {
            if (PyBytes_CheckExact(h)) {
                PyErr_Format(PyExc_TypeError,
                             "%U[%zd]: expected a %zd-byte digest (bytes), got %zd bytes", name,
                             i, size, PyBytes_GET_SIZE(h));
            }
            else {
                PyErr_Format(PyExc_TypeError,
                             "%U[%zd]: expected a %zd-byte digest (bytes), got %s", name, i,
                             size, Py_TYPE(h)->tp_name);
            }
            return -1;
        }
    }
    return 0;
}

/* Raises ValueError when an entry of `items` (bytes of `size` bytes each, checked)
 * repeats: one pass over them and an open-addressing table of their hashes. */
static int
check_digests_distinct(PyObject **items, Py_ssize_t n, PyObject *name, Py_ssize_t size)
{
    if (n < 2) {
        return 0;
    }
    size_t cap = 8;
    while (cap < (size_t)n * 2) {
        cap <<= 1;
    }
    PyObject *buf[512], **table = buf;
    if (cap > 512) {
        table = PyMem_Calloc(cap, sizeof(PyObject *));
        if (table == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    else {
        memset(buf, 0, cap * sizeof(PyObject *));
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        PyObject *h = items[i];
        Py_hash_t hash = size == DIGEST_SIZE ? digest_hash(PyBytes_AS_STRING(h))
                                             : PyObject_Hash(h); /* bytes: never fails */
        size_t b = (size_t)hash & (cap - 1);
        while (table[b] != NULL) {
            PyObject *other = table[b];
            if (other == h || memcmp(PyBytes_AS_STRING(other), PyBytes_AS_STRING(h), size) == 0) {
                PyErr_Format(PyExc_ValueError,
                             "%U: a hash appears twice (chained hashes never repeat)", name);
                rc = -1;
                break;
            }
            b = (b + 1) & (cap - 1);
        }
        table[b] = h;
    }
    if (table != buf) {
        PyMem_Free(table);
    }
    return rc;
}

/* check_digests(hashes, name, size, distinct=True): raises unless `hashes` (a
 * list) holds `bytes` of exactly `size` bytes each (TypeError naming the first
 * entry that is not) and, with `distinct`, no entry repeats (ValueError). The
 * checks RequestState's hashes pass (request.checked_hashes), in one pass over
 * the list and a table of its hashes instead of three sets. */
static PyObject *
check_digests(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if ((nargs != 3 && nargs != 4) || !PyList_Check(args[0]) || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "check_digests(hashes: list, name: str, size: int, distinct=True)");
        return NULL;
    }
    PyObject *list = args[0], *name = args[1];
    Py_ssize_t size = PyLong_AsSsize_t(args[2]);
    if (size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int distinct = nargs == 4 ? PyObject_IsTrue(args[3]) : 1;
    if (distinct < 0) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject **items = ((PyListObject *)list)->ob_item;
    if (check_digest_types(items, n, name, size) < 0 ||
        (distinct && check_digests_distinct(items, n, name, size) < 0)) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* array.array: the type of the block tables match_path hands back. */
static PyObject *array_type;
static PyObject *int32_code; /* "i": a C int */
_Static_assert(sizeof(int) == sizeof(int32_t), "array('i') holds int32");

/* A new array('i') of the n int32 values at ids: one copy, no int object per value. */
static PyObject *
int32_array(const int32_t *ids, Py_ssize_t n)
{
    PyObject *raw = PyBytes_FromStringAndSize((const char *)ids, n * (Py_ssize_t)sizeof(int32_t));
    if (raw == NULL) {
        return NULL;
    }
    PyObject *arr = PyObject_CallFunctionObjArgs(array_type, int32_code, raw, NULL);
    Py_DECREF(raw);
    return arr;
}

/* append_ids(table, ids): table.fromlist(ids) for a list of block ids, converted
 * in one pass (array's own conversion parses every item as a format): an
 * array('i') table, a list of ints in [-1, INT32_MAX]. Raises TypeError or
 * OverflowError naming the first bad id, with nothing appended. */
static PyObject *
append_ids(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyObject_TypeCheck(args[0], (PyTypeObject *)array_type) ||
        !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "append_ids(table: array, ids: list)");
        return NULL;
    }
    PyObject *code = PyObject_GetAttrString(args[0], "typecode");
    int is_int32 = code != NULL && PyUnicode_Check(code) && PyUnicode_Compare(code, int32_code) == 0;
    Py_XDECREF(code);
    if (!is_int32) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "append_ids: table must be an array('i')");
        }
        return NULL;
    }
    PyObject *list = args[1];
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (n == 0) {
        Py_RETURN_NONE;
    }
    PyObject *raw = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int32_t));
    if (raw == NULL) {
        return NULL;
    }
    int32_t *out = (int32_t *)PyBytes_AS_STRING(raw);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v;
        PyObject *item = PyList_GET_ITEM(list, i);
        if (!PyLong_CheckExact(item)) {
            PyErr_Format(PyExc_TypeError, "ids[%zd]: a block id must be an int, got %.100s", i,
                         Py_TYPE(item)->tp_name);
            Py_DECREF(raw);
            return NULL;
        }
        int overflow;
        v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow || v < -1 || v > INT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "ids[%zd]: block id %R is out of range [-1, %lld]",
                         i, item, (long long)INT32_MAX);
            Py_DECREF(raw);
            return NULL;
        }
        out[i] = (int32_t)v;
    }
    PyObject *r = PyObject_CallMethod(args[0], "frombytes", "O", raw);
    Py_DECREF(raw);
    return r;
}

#define STATE_SWAP_TO_DEVICE 3
#define STATE_PENDING_HOST 5
#define STATE_LOADING_FROM_STORAGE 7

/* match_path(tree, root, hashes, limit, index, device_lru, name=None):
 * RadixTree.match_and_lock's walk in one call. Follows the path of `hashes` (at most `limit`) from `root`
 * while each key's node hangs under the previous one and holds a readable copy,
 * then locks the nodes found: an unlocked device-only node on `device_lru` is
 * unlinked here, any other unlocked node goes to `tree._unlist(node)` (the general
 * case: parked sets, a node being evicted) before its lock is counted.
 *
 * Returns (nodes, blocks, num_host, waiting): the locked nodes, the device blocks
 * of those before the first host-only one, how many are host-only, and whether the
 * walk stopped at a copy in flight. Everything that can fail for want of memory
 * happens before the first lock; if `_unlist` raises, the locks taken are given
 * back through `tree.unlock`.
 *
 * With `name` (a str), `hashes` must be distinct digests, else TypeError or
 * ValueError naming it, raised before anything is locked: checked only when
 * the walk stopped before the end of `hashes`, since a path of the tree never
 * repeats a key (each key indexes one node, and parent links have no cycles). */
static PyObject *
match_path(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "match_path(tree, root, hashes, limit, index, device_lru, name=None)");
        return NULL;
    }
    PyObject *name = nargs == 7 && args[6] != Py_None ? args[6] : NULL;
    if (!TreeNode_Check(args[1]) || !PyList_Check(args[2]) ||
        !Py_IS_TYPE(args[4], &NodeIndexType) || (name != NULL && !PyUnicode_Check(name))) {
        PyErr_SetString(PyExc_TypeError,
                        "match_path: root must be a TreeNode, hashes a list, index a NodeIndex, "
                        "name a str or None");
        return NULL;
    }
    LRUListObject *device_lru = as_lru(args[5], "device_lru");
    if (device_lru == NULL) {
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    if (limit == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *tree = args[0], *hashes = args[2];
    NodeIndexObject *index = (NodeIndexObject *)args[4];
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    if (limit < n) {
        n = limit < 0 ? 0 : limit;
    }
    PyObject *nodes = PyList_New(n);
    if (nodes == NULL) {
        return NULL;
    }
    /* The device blocks as int32, an array('i') at the end: no int object per
     * block (block ids are int32, see block_pool.MAX_BLOCKS). */
    int32_t ids_buf[256], *block_ids = ids_buf;
    if (n > 256 && (block_ids = PyMem_Malloc(n * sizeof(int32_t))) == NULL) {
        Py_DECREF(nodes);
        return PyErr_NoMemory();
    }
    PyObject *blocks = NULL;
    /* Pass 1: find the path; nothing changes. */
    TreeNodeObject *parent = (TreeNodeObject *)args[1];
    Py_ssize_t matched = 0, num_blocks = 0, num_host = 0;
    int waiting = 0;
    for (; matched < n; matched++) {
        PyObject *key = PyList_GET_ITEM(hashes, matched);
        TreeNodeObject *node;
        if (index->num_ref_keys == 0 && is_digest(key)) { /* the cache manager's keys */
            const unsigned char *digest = (const unsigned char *)PyBytes_AS_STRING(key);
            node = index_find_digest(index, digest, digest_hash(digest));
        }
        else {
            Py_hash_t h = key_hash(key);
            if (h == -1) {
                goto error;
            }
            node = index_find(index, key, h, NULL);
            if (node == NULL && PyErr_Occurred()) {
                goto error;
            }
        }
        if (node == NULL) {
            break;
        }
        if (node->parent != (PyObject *)parent) {
            break;
        }
        uint8_t state = node->state;
        if (state == STATE_SWAP_TO_DEVICE || state == STATE_PENDING_HOST ||
            state == STATE_LOADING_FROM_STORAGE) {
            waiting = 1;
            break;
        }
        Py_INCREF(node);
        PyList_SET_ITEM(nodes, matched, (PyObject *)node);
        if (state == STATE_HOST) {
            num_host++;
        }
        else if (num_host == 0) {
            block_ids[num_blocks++] = node->device_block;
        }
        parent = node;
    }
    Py_SET_SIZE(nodes, matched); /* shrinking never fails */
    if (name != NULL && matched < PyList_GET_SIZE(hashes)) {
        PyObject **items = ((PyListObject *)hashes)->ob_item;
        Py_ssize_t size = PyList_GET_SIZE(hashes);
        if (check_digest_types(items, size, name, DIGEST_SIZE) < 0 ||
            check_digests_distinct(items, size, name, DIGEST_SIZE) < 0) {
            goto error;
        }
    }
    blocks = int32_array(block_ids, num_blocks);
    if (blocks == NULL) {
        goto error;
    }
    PyObject *result = Py_BuildValue("(OOnO)", nodes, blocks, num_host,
                                     waiting ? Py_True : Py_False);
    if (result == NULL) {
        goto error;
    }
    /* Pass 2: lock them. */
    int ds = device_lru->slot;
    for (Py_ssize_t i = 0; i < matched; i++) {
        TreeNodeObject *node = (TreeNodeObject *)PyList_GET_ITEM(nodes, i);
        if (!node->ref) {
            if (node->host_block < 0 && node->owner[ds] == device_lru->id) {
                Py_DECREF(unlink_node(device_lru, node)); /* the index still holds it */
            }
            else {
                PyObject *r = PyObject_CallMethod(tree, "_unlist", "O", (PyObject *)node);
                if (r == NULL) {
                    Py_DECREF(result);
                    PyObject *type, *value, *tb;
                    PyErr_Fetch(&type, &value, &tb);
                    Py_SET_SIZE(nodes, i); /* give back the locks taken */
                    PyObject *u = PyObject_CallMethod(tree, "unlock", "O", nodes);
                    Py_XDECREF(u);
                    Py_SET_SIZE(nodes, matched);
                    if (u == NULL) {
                        PyErr_Clear();
                    }
                    PyErr_Restore(type, value, tb);
                    goto error;
                }
                Py_DECREF(r);
            }
        }
        node->ref++;
    }
    Py_DECREF(nodes);
    Py_DECREF(blocks);
    if (block_ids != ids_buf) {
        PyMem_Free(block_ids);
    }
    return result;
error:
    Py_SET_SIZE(nodes, matched);
    Py_DECREF(nodes);
    Py_XDECREF(blocks);
    if (block_ids != ids_buf) {
        PyMem_Free(block_ids);
    }
    return NULL;
}

/* -- module ------------------------------------------------------------------ */

/* Installs `members` (a tuple of n ints equal to their positions: an IntEnum's
 * members in order) as `table`; `what` names the call and the enum in errors. */
static PyObject *
install_members(PyObject *members, PyObject **table, Py_ssize_t n, const char *what,
                const char *enum_name)
{
    if (!PyTuple_Check(members) || PyTuple_GET_SIZE(members) != n) {
        PyErr_Format(PyExc_ValueError, "%s: needs a tuple of the %zd %s members", what, n,
                     enum_name);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyTuple_GET_ITEM(members, i);
        long v = PyLong_Check(m) ? PyLong_AsLong(m) : -1;
        if (v != i) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s: member %zd is %R, not an int equal to %zd",
                         what, i, m, i);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyTuple_GET_ITEM(members, i);
        Py_INCREF(m);
        Py_XSETREF(table[i], m);
    }
    Py_RETURN_NONE;
}

static PyObject *
set_states(PyObject *module, PyObject *members)
{
    return install_members(members, states, NUM_STATES, "set_states", "NodeState");
}

static PyObject *
set_storage_states(PyObject *module, PyObject *members)
{
    return install_members(members, storage_states, NUM_STORAGE, "set_storage_states",
                           "StorageState");
}

/* The arena's live nodes and mapped slabs (what a leak or a kept slab shows in). */
static PyObject *
arena_stats(PyObject *module, PyObject *unused)
{
    unsigned long long live = 0, slabs = 0;
    for (uint32_t i = 0; i < arena_num_slabs; i++) {
        if (arena_slabs[i] != NULL) {
            live += ((Slab *)arena_slabs[i])->live;
            slabs++;
        }
    }
    return Py_BuildValue("(KK)", live, slabs);
}

static PyMethodDef module_methods[] = {
    {"arena_stats", arena_stats, METH_NOARGS,
     "arena_stats(): (live nodes, mapped slabs) of the TreeNode arena."},
    {"unlock_path", (PyCFunction)(void (*)(void))unlock_path, METH_FASTCALL,
     "unlock_path(nodes, device_lru, host_lru): RadixTree.unlock's loop."},
    {"discard_leaves", (PyCFunction)(void (*)(void))discard_leaves, METH_FASTCALL,
     "discard_leaves(lru, parked, index, n): RadixTree.discard_device_leaves' loop."},
    {"make_path", (PyCFunction)(void (*)(void))make_path, METH_FASTCALL,
     "make_path(parent, keys, device_blocks, index): new locked DEVICE nodes, one per "
     "key, each the parent of the next, entered in index; returns them."},
    {"match_path", (PyCFunction)(void (*)(void))match_path, METH_FASTCALL,
     "match_path(tree, root, hashes, limit, index, device_lru, name=None): "
     "RadixTree.match_and_lock's "
     "walk; returns (nodes, blocks, num_host, waiting)."},
    {"append_ids", (PyCFunction)(void (*)(void))append_ids, METH_FASTCALL,
     "append_ids(table, ids): append a list of block ids to an array('i') table in one "
     "pass; TypeError or OverflowError naming the first bad id, nothing appended."},
    {"check_digests", (PyCFunction)(void (*)(void))check_digests, METH_FASTCALL,
     "check_digests(hashes, name, size, distinct=True): raise unless the list holds bytes "
     "of `size` bytes each (TypeError naming the first that is not) and, with `distinct`, "
     "none repeats (ValueError)."},
    {"set_states", set_states, METH_O,
     "set_states(members): the NodeState members, by value, that TreeNode.state returns."},
    {"set_storage_states", set_storage_states, METH_O,
     "set_storage_states(members): the StorageState members, by value, that "
     "TreeNode.storage returns."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fastkv.scheduler._tree_node",
    .m_doc = "Radix tree nodes and eviction lists outside the cyclic garbage collector.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__tree_node(void)
{
    if (PyType_Ready(&TreeNodeType) < 0 || PyType_Ready(&LRUListType) < 0 ||
        PyType_Ready(&LRUIterType) < 0 || PyType_Ready(&NodeIndexType) < 0) {
        return NULL;
    }
    if (array_type == NULL) {
        PyObject *array_module = PyImport_ImportModule("array");
        if (array_module == NULL) {
            return NULL;
        }
        array_type = PyObject_GetAttrString(array_module, "array");
        Py_DECREF(array_module);
        int32_code = PyUnicode_InternFromString("i");
        if (array_type == NULL || int32_code == NULL) {
            return NULL;
        }
    }
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "TreeNode", (PyObject *)&TreeNodeType) < 0 ||
        PyModule_AddObjectRef(m, "LRUList", (PyObject *)&LRUListType) < 0 ||
        PyModule_AddObjectRef(m, "NodeIndex", (PyObject *)&NodeIndexType) < 0 ||
        PyModule_AddIntConstant(m, "NODE_SIZE", (long)sizeof(TreeNodeObject)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
