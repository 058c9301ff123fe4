/* The lazy DFA of a byte NFA and the token-trie walk of a mask, in plain C (byte_dfa.py and
 * token_trie.py hold the Python path this mirrors, and the semantics).
 *
 * A DFA state is an epsilon-closed set of NFA states, named by its sorted members; its row of
 * 256 int32 transitions is made the first time a walk needs it. Every byte this file holds is
 * counted in `allocated`; an allocation that would pass `mem_limit` (set by the caller from
 * the grammar's MemoryBudget) fails with ERR_MEMORY and `needed` says how much it wanted
 * (-1: malloc failed), leaving the DFA as it was (a row is written only once complete). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DEAD (-1)
#define UNKNOWN (-2)
#define ERR_LIMIT (-3)  /* more new states than the caller's bound */
#define ERR_MEMORY (-4) /* the memory limit (or malloc) refused an allocation */
#define ERR_STATE (-5)  /* a state the DFA does not have */

#define CHECK_STATE(d, state) \
    if ((state) < 0 || (state) >= (d)->num_states) return ERR_STATE

typedef struct {
    int64_t off; /* in keys */
    int32_t len, value;
    uint32_t hash;
} Entry;

typedef struct {
    Entry *entries;
    int64_t count, cap; /* cap: a power of two (0: empty) */
} Map;

typedef struct {
    /* the NFA */
    int32_t num_nfa, start, final;
    int32_t *edge_at, *edge_low, *edge_high, *edge_to, *eps_at, *eps_to;
    /* the DFA */
    int32_t *table;                 /* rows * 256 */
    int64_t rows;                   /* allocated rows */
    int32_t num_states;
    int64_t *core_at;               /* per state: its cores' start in core_pool (num_states + 1) */
    int64_t core_cap, accepting_cap;
    int32_t *core_pool;
    int64_t core_len, core_pool_cap;
    uint8_t *accepting;
    int32_t *keys;                  /* the key sets of both maps */
    int64_t keys_len, keys_cap;
    Map ids, after;                 /* closure -> state, byte targets -> state */
    /* scratch */
    int32_t *mark, *stack, *buf;    /* num_nfa each */
    int32_t stamp;
    /* memory */
    int64_t allocated, mem_limit, needed;
} DFA;

/* -- memory ---------------------------------------------------------------------------------- */

/* `*ptr` resized from `old` to `new` bytes, charged to `allocated`; 0 on success. */
static int resize(DFA *d, void **ptr, int64_t old, int64_t new) {
    if (new > old && d->allocated + (new - old) > d->mem_limit) {
        d->needed = new - old;
        return -1;
    }
    void *p = realloc(*ptr, (size_t)(new > 0 ? new : 1));
    if (p == NULL) {
        d->needed = -1; /* malloc failed: no budget would help */
        return -1;
    }
    *ptr = p;
    d->allocated += new - old;
    return 0;
}

static int64_t grown(int64_t cap, int64_t want) {
    int64_t n = cap > 0 ? cap : 16;
    while (n < want) n *= 2;
    return n;
}

/* -- hash maps of sorted int sets ------------------------------------------------------------ */

static uint32_t hash_set(const int32_t *set, int32_t len) {
    uint32_t h = 2166136261u ^ (uint32_t)len;
    for (int32_t i = 0; i < len; i++) h = (h ^ (uint32_t)set[i]) * 16777619u;
    return h ? h : 1;
}

static int64_t find_slot(const DFA *d, const Map *m, const int32_t *set, int32_t len, uint32_t h) {
    int64_t mask = m->cap - 1, i = h & mask;
    while (m->entries[i].hash) {
        const Entry *e = &m->entries[i];
        if (e->hash == h && e->len == len && memcmp(d->keys + e->off, set, (size_t)len * 4) == 0) return i;
        i = (i + 1) & mask;
    }
    return i;
}

static int32_t map_get(const DFA *d, const Map *m, const int32_t *set, int32_t len) {
    if (m->cap == 0) return -1;
    int64_t i = find_slot(d, m, set, len, hash_set(set, len));
    return m->entries[i].hash ? m->entries[i].value : -1;
}

static int map_grow(DFA *d, Map *m) {
    int64_t cap = m->cap ? 2 * m->cap : 64;
    Entry *entries = NULL;
    if (resize(d, (void **)&entries, 0, cap * (int64_t)sizeof(Entry))) return -1;
    memset(entries, 0, (size_t)cap * sizeof(Entry));
    for (int64_t i = 0; i < m->cap; i++) {
        Entry e = m->entries[i];
        if (!e.hash) continue;
        int64_t j = e.hash & (cap - 1);
        while (entries[j].hash) j = (j + 1) & (cap - 1);
        entries[j] = e;
    }
    free(m->entries);
    d->allocated -= m->cap * (int64_t)sizeof(Entry);
    m->entries = entries;
    m->cap = cap;
    return 0;
}

/* Adds set -> value (the set not in the map); 0 on success, the map unchanged on failure. */
static int map_put(DFA *d, Map *m, const int32_t *set, int32_t len, int32_t value) {
    if (2 * (m->count + 1) > m->cap && map_grow(d, m)) return -1;
    if (d->keys_len + len > d->keys_cap) {
        int64_t cap = grown(d->keys_cap, d->keys_len + len);
        if (resize(d, (void **)&d->keys, d->keys_cap * 4, cap * 4)) return -1;
        d->keys_cap = cap;
    }
    memcpy(d->keys + d->keys_len, set, (size_t)len * 4);
    uint32_t h = hash_set(set, len);
    int64_t i = find_slot(d, m, set, len, h);
    m->entries[i] = (Entry){d->keys_len, len, value, h};
    d->keys_len += len;
    m->count++;
    return 0;
}

/* -- determinization ------------------------------------------------------------------------- */

static int cmp_int(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The epsilon closure of `set` (`len` NFA states) into d->buf, sorted; its size. */
static int32_t closure(DFA *d, const int32_t *set, int32_t len) {
    int32_t stamp = ++d->stamp, size = 0, top = 0;
    if (stamp == INT32_MAX) { /* restart the stamps */
        memset(d->mark, 0, (size_t)d->num_nfa * 4);
        stamp = d->stamp = 1;
    }
    for (int32_t i = 0; i < len; i++) {
        if (d->mark[set[i]] != stamp) {
            d->mark[set[i]] = stamp;
            d->buf[size++] = d->stack[top++] = set[i];
        }
    }
    while (top) {
        int32_t s = d->stack[--top];
        for (int32_t i = d->eps_at[s]; i < d->eps_at[s + 1]; i++) {
            int32_t t = d->eps_to[i];
            if (d->mark[t] != stamp) {
                d->mark[t] = stamp;
                d->buf[size++] = d->stack[top++] = t;
            }
        }
    }
    qsort(d->buf, (size_t)size, 4, cmp_int);
    return size;
}

/* Adds the state of `key` (a sorted closure); its id, or ERR_MEMORY (nothing added). */
static int32_t new_state(DFA *d, const int32_t *key, int32_t len) {
    int32_t state = d->num_states, cores = 0;
    for (int32_t i = 0; i < len; i++) cores += d->edge_at[key[i] + 1] > d->edge_at[key[i]];
    if (state + 2 > d->core_cap) {
        int64_t cap = grown(d->core_cap, state + 2);
        if (resize(d, (void **)&d->core_at, d->core_cap * 8, cap * 8)) return ERR_MEMORY;
        d->core_cap = cap;
    }
    if (state + 1 > d->accepting_cap) {
        int64_t cap = grown(d->accepting_cap, state + 1);
        if (resize(d, (void **)&d->accepting, d->accepting_cap, cap)) return ERR_MEMORY;
        d->accepting_cap = cap;
    }
    if (d->core_len + cores > d->core_pool_cap) {
        int64_t cap = grown(d->core_pool_cap, d->core_len + cores);
        if (resize(d, (void **)&d->core_pool, d->core_pool_cap * 4, cap * 4)) return ERR_MEMORY;
        d->core_pool_cap = cap;
    }
    if (state >= d->rows) {
        int64_t rows = 2 * d->rows;
        if (resize(d, (void **)&d->table, d->rows * 1024, rows * 1024)) return ERR_MEMORY;
        for (int64_t i = d->rows * 256; i < rows * 256; i++) d->table[i] = UNKNOWN;
        d->rows = rows;
    }
    if (map_put(d, &d->ids, key, len, state)) return ERR_MEMORY;
    int64_t at = d->core_len;
    int accepting = 0;
    for (int32_t i = 0; i < len; i++) {
        if (d->edge_at[key[i] + 1] > d->edge_at[key[i]]) d->core_pool[at++] = key[i];
        accepting |= key[i] == d->final;
    }
    d->core_at[state] = d->core_len;
    d->core_at[state + 1] = d->core_len = at;
    d->accepting[state] = (uint8_t)accepting;
    d->num_states = state + 1;
    return state;
}

/* The DFA state of the closure of `targets` (sorted, distinct), or ERR_MEMORY. */
static int32_t intern(DFA *d, const int32_t *targets, int32_t len) {
    int32_t state = map_get(d, &d->after, targets, len);
    if (state >= 0) return state;
    int32_t size = closure(d, targets, len);
    state = map_get(d, &d->ids, d->buf, size);
    if (state < 0) state = new_state(d, d->buf, size);
    if (state < 0) return state;
    return map_put(d, &d->after, targets, len, state) ? ERR_MEMORY : state;
}

/* Makes `state`'s row; 0, ERR_LIMIT when the DFA has more than `limit` states (< 0: no
 * bound), or ERR_MEMORY. The row is written only once complete. */
static int32_t compute_row(DFA *d, int32_t state, int64_t limit) {
    if (limit >= 0 && d->num_states > limit) return ERR_LIMIT;
    int32_t row[256];
    uint8_t cut[257] = {0};
    int32_t *targets = NULL;
    int64_t count = 0, first = d->core_at[state], last = d->core_at[state + 1];
    for (int64_t c = first; c < last; c++) {
        int32_t s = d->core_pool[c];
        for (int32_t i = d->edge_at[s]; i < d->edge_at[s + 1]; i++) {
            cut[d->edge_low[i]] = cut[d->edge_high[i] + 1] = 1;
            count++;
        }
    }
    for (int i = 0; i < 256; i++) row[i] = DEAD;
    if (count && resize(d, (void **)&targets, 0, count * 4)) return ERR_MEMORY;
    int32_t result = 0;
    for (int a = 0; a < 256 && result == 0;) {
        int b = a + 1;
        while (b < 256 && !cut[b]) b++;
        int32_t len = 0;
        for (int64_t c = first; c < last; c++) {
            int32_t s = d->core_pool[c];
            for (int32_t i = d->edge_at[s]; i < d->edge_at[s + 1]; i++)
                if (d->edge_low[i] <= a && a <= d->edge_high[i]) targets[len++] = d->edge_to[i];
        }
        if (len) {
            qsort(targets, (size_t)len, 4, cmp_int);
            int32_t n = 1;
            for (int32_t i = 1; i < len; i++)
                if (targets[i] != targets[n - 1]) targets[n++] = targets[i];
            int32_t next = intern(d, targets, n);
            if (next < 0) result = next;
            for (int i = a; i < b; i++) row[i] = next;
        }
        a = b;
    }
    if (targets) {
        free(targets);
        d->allocated -= count * 4;
    }
    if (result == 0) memcpy(d->table + (int64_t)state * 256, row, sizeof(row));
    return result;
}

static inline int32_t ensure_row(DFA *d, int32_t state, int64_t limit) {
    if (d->table[(int64_t)state * 256] != UNKNOWN) return 0;
    return compute_row(d, state, limit);
}

/* -- the Python interface -------------------------------------------------------------------- */

static int copy_ints(DFA *d, int32_t **dst, const int32_t *src, int64_t n) {
    if (resize(d, (void **)dst, 0, n * 4)) return -1;
    memcpy(*dst, src, (size_t)n * 4);
    return 0;
}

void spruce_dfa_free(DFA *d) {
    if (d == NULL) return;
    void *parts[] = {d->edge_at, d->edge_low, d->edge_high, d->edge_to, d->eps_at, d->eps_to,
                     d->table, d->core_at, d->core_pool, d->accepting, d->keys, d->ids.entries,
                     d->after.entries, d->mark, d->stack, d->buf};
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) free(parts[i]);
    free(d);
}

/* A DFA of the NFA's arrays (copied), with its initial state (0) made; NULL when the arrays
 * and first rows need more than `mem_limit` bytes, `*need` then the bytes it would have held
 * (-1: malloc failed). */
DFA *spruce_dfa_new(int32_t num_nfa, int32_t num_edges, int32_t num_eps, int32_t start, int32_t final,
                    const int32_t *edge_at, const int32_t *edge_low, const int32_t *edge_high,
                    const int32_t *edge_to, const int32_t *eps_at, const int32_t *eps_to, int64_t mem_limit,
                    int64_t *need) {
    DFA *d = calloc(1, sizeof(DFA));
    *need = -1;
    if (d == NULL) return NULL;
    d->allocated = sizeof(DFA);
    d->mem_limit = mem_limit;
    d->num_nfa = num_nfa, d->start = start, d->final = final;
    int64_t n = num_nfa > 0 ? num_nfa : 1;
    int failed = copy_ints(d, &d->edge_at, edge_at, num_nfa + 1) || copy_ints(d, &d->edge_low, edge_low, num_edges)
              || copy_ints(d, &d->edge_high, edge_high, num_edges) || copy_ints(d, &d->edge_to, edge_to, num_edges)
              || copy_ints(d, &d->eps_at, eps_at, num_nfa + 1) || copy_ints(d, &d->eps_to, eps_to, num_eps)
              || resize(d, (void **)&d->mark, 0, n * 4) || resize(d, (void **)&d->stack, 0, n * 4)
              || resize(d, (void **)&d->buf, 0, n * 4) || resize(d, (void **)&d->table, 0, 64 * 1024);
    if (!failed) {
        memset(d->mark, 0, (size_t)n * 4);
        d->rows = 64;
        for (int64_t i = 0; i < 64 * 256; i++) d->table[i] = UNKNOWN;
        failed = intern(d, &d->start, 1) != 0;
    }
    if (failed) {
        *need = d->needed < 0 ? -1 : d->allocated + d->needed;
        spruce_dfa_free(d);
        return NULL;
    }
    return d;
}

int64_t spruce_dfa_allocated(const DFA *d) { return d->allocated; }
int64_t spruce_dfa_needed(const DFA *d) { return d->needed; }
int32_t spruce_dfa_num_states(const DFA *d) { return d->num_states; }
int32_t spruce_dfa_is_accepting(const DFA *d, int32_t state) {
    CHECK_STATE(d, state);
    return d->accepting[state];
}

/* Copies row `state` of the table into `out` (256 ints); 0 or ERR_STATE. */
int32_t spruce_dfa_copy_row(const DFA *d, int32_t state, int32_t *out) {
    CHECK_STATE(d, state);
    memcpy(out, d->table + (int64_t)state * 256, 1024);
    return 0;
}

/* Makes the missing rows of `states`; 0, ERR_LIMIT or ERR_MEMORY. */
int32_t spruce_dfa_ensure_rows(DFA *d, const int32_t *states, int64_t count, int64_t limit, int64_t mem_limit) {
    d->mem_limit = mem_limit;
    for (int64_t i = 0; i < count; i++) {
        CHECK_STATE(d, states[i]);
        int32_t result = ensure_row(d, states[i], limit);
        if (result) return result;
    }
    return 0;
}

/* The state after reading `data` from `state` (DEAD once a byte has no transition), or
 * ERR_MEMORY. */
int32_t spruce_dfa_walk(DFA *d, int32_t state, const uint8_t *data, int64_t len, int64_t mem_limit) {
    if (state == DEAD) return DEAD;
    CHECK_STATE(d, state);
    d->mem_limit = mem_limit;
    for (int64_t i = 0; i < len && state >= 0; i++) {
        int32_t result = ensure_row(d, state, -1);
        if (result) return result;
        state = d->table[(int64_t)state * 256 + data[i]];
    }
    return state;
}

/* The forced bytes of `state` into `out` (at most `max`, see ByteDFA.forced_bytes): their
 * count, or ERR_MEMORY. A state seen twice ends the chain. */
int64_t spruce_dfa_forced(DFA *d, int32_t state, uint8_t *out, int64_t max, int64_t mem_limit) {
    CHECK_STATE(d, state);
    d->mem_limit = mem_limit;
    int32_t *seen = NULL; /* the DFA states seen */
    int64_t seen_bytes = (int64_t)(max + 1) * 4, len = 0;
    if (resize(d, (void **)&seen, 0, seen_bytes)) return ERR_MEMORY;
    int64_t num_seen = 0;
    seen[num_seen++] = state;
    int64_t result = 0;
    while (len < max && !d->accepting[state]) {
        int32_t err = ensure_row(d, state, -1);
        if (err) {
            result = err;
            break;
        }
        const int32_t *row = d->table + (int64_t)state * 256;
        int live = 0, byte = 0;
        for (int i = 0; i < 256 && live < 2; i++)
            if (row[i] >= 0) live++, byte = i;
        if (live != 1) break;
        out[len++] = (uint8_t)byte;
        state = row[byte];
        int again = 0;
        for (int64_t i = 0; i < num_seen && !again; i++) again = seen[i] == state;
        if (again) break;
        seen[num_seen++] = state;
    }
    free(seen);
    d->allocated -= seen_bytes;
    return result ? result : len;
}

/* out[t] = 1 for the tokens t of the nodes marked in `alive`, 0 for the others: the nodes
 * found by scanning `alive` 32 bytes at a time when few are marked (`marked`), else each
 * token's node looked up. */
static void set_tokens(const uint8_t *alive, int64_t num_nodes, int64_t marked, const int32_t *token_node,
                       const int32_t *node_token_at, const int32_t *node_tokens, int64_t num_tokens, uint8_t *out) {
    if (marked > num_tokens / 16) {
        for (int64_t i = 0; i < num_tokens; i++) out[i] = token_node[i] < num_nodes && alive[token_node[i]];
        return;
    }
    memset(out, 0, (size_t)num_tokens);
    for (int64_t at = 0; at < num_nodes; at += 32) {
        if (at + 32 <= num_nodes) {
            uint64_t words[4];
            memcpy(words, alive + at, 32);
            if ((words[0] | words[1] | words[2] | words[3]) == 0) continue;
        }
        for (int64_t node = at; node < at + 32 && node < num_nodes; node++) {
            if (!alive[node]) continue;
            for (int32_t k = node_token_at[node], end = node_token_at[node + 1]; k < end; k++) out[node_tokens[k]] = 1;
        }
    }
}

/* The token mask of `state`: out[t] = 1 when the DFA reads token t's bytes from `state`.
 * The trie (`num_nodes` nodes numbered breadth first, a node's children consecutive, `byte`
 * the byte into a node; token t's node is token_node[t], num_nodes for none; node n's tokens
 * are node_tokens[node_token_at[n]:node_token_at[n + 1]]) is walked level by level, cut
 * where the DFA has no transition, making rows on the way: each level's (node, state) pairs
 * are in node order, so the arrays are read front to back, and a node's children are read in
 * one branch-free loop that keeps those to descend into; then the tokens of the nodes
 * reached are set (set_tokens). 0, ERR_LIMIT when a row would be made with more than
 * `limit` states (>= 0), or ERR_MEMORY; the rows made are kept either way. */
int32_t spruce_dfa_mask(DFA *d, int32_t state, int64_t limit, const int32_t *child_start,
                        const int32_t *child_count, const uint8_t *byte, int64_t num_nodes,
                        const int32_t *token_node, const int32_t *node_token_at, const int32_t *node_tokens,
                        int64_t num_tokens, uint8_t *out, int64_t mem_limit) {
    CHECK_STATE(d, state);
    d->mem_limit = mem_limit;
    int64_t caps[2] = {1024, 1024}, size = 0, marked = 0; /* two levels of (node, its state) pairs */
    int32_t *levels[2] = {NULL, NULL}, result = 0;
    uint8_t *alive = NULL; /* per node: reached */
    if (resize(d, (void **)&alive, 0, num_nodes)) return ERR_MEMORY;
    memset(alive, 0, (size_t)num_nodes);
    if (resize(d, (void **)&levels[0], 0, caps[0] * 8)) result = ERR_MEMORY;
    if (resize(d, (void **)&levels[1], 0, caps[1] * 8)) result = ERR_MEMORY;
    if (result == 0 && child_count[0] > 0) levels[0][0] = 0, levels[0][1] = state, size = 1;
    for (int cur = 0; size > 0 && result == 0; cur ^= 1) {
        int32_t *from = levels[cur];
        int64_t kept = 0;
        for (int64_t i = 0; i < size && result == 0; i++) {
            int32_t node = from[2 * i], at = from[2 * i + 1];
            int32_t first = child_start[node], count = child_count[node];
            result = ensure_row(d, at, limit);
            if (result == 0 && kept + count > caps[cur ^ 1]) {
                int64_t more = grown(caps[cur ^ 1], kept + count);
                result = resize(d, (void **)&levels[cur ^ 1], caps[cur ^ 1] * 8, more * 8) ? ERR_MEMORY : 0;
                if (result == 0) caps[cur ^ 1] = more;
            }
            if (result) break;
            int32_t *to = levels[cur ^ 1];
            const int32_t *row = d->table + (int64_t)at * 256;
            for (int32_t child = first; child < first + count; child++) {
                int32_t next = row[byte[child]];
                int live = next >= 0;
                alive[child] = (uint8_t)live;
                marked += live;
                to[2 * kept] = child, to[2 * kept + 1] = next;
                kept += live & (child_count[child] > 0);
            }
        }
        size = kept;
    }
    for (int i = 0; i < 2; i++) {
        free(levels[i]);
        d->allocated -= levels[i] ? caps[i] * 8 : 0;
    }
    if (result == 0) set_tokens(alive, num_nodes, marked, token_node, node_token_at, node_tokens, num_tokens, out);
    free(alive);
    d->allocated -= num_nodes;
    return result;
}
