"""Numba kernels for byte-level BPE: learning merges from a corpus, and applying them to words.

All take words as one array: the symbols of every distinct pretoken laid end to end, with offsets.
In nanoeuler's own tokenizers merge r joins a pair of earlier ids into the new id 256 + r
(`learn_merges`, `apply_merges`); a tokenizer from elsewhere has its own ids for the bytes and
for what each merge makes, and is applied with Hugging Face's exact algorithm
(`apply_merges_queued`).

Training (`learn_merges`) computes pair counts once; after that each merge visits only the
positions where its pair occurs (found through per-pair occurrence lists) and adjusts the counts
of the neighbouring pairs it destroys and creates. A max-heap with lazy deletion yields the most
frequent pair. Training therefore costs about (symbols merged) x log(pairs), never
(merges x corpus).

Sizes: L symbol positions, W distinct words, P distinct pairs, V tokens.
"""

import numpy as np
from numba import njit, types
from numba.typed import Dict

KEY, COUNT, HEAD, TOUCHED = 0, 1, 2, 3  # columns of the pair table
POSITION, NEXT = 0, 1  # columns of the occurrence pool (singly linked lists, one per pair)
N_PAIRS, N_OCCURRENCES, N_NODES = 0, 1, 2  # entries of `sizes`, the fill level of each table


@njit(cache=True)
def _grow_rows(table, needed):
    # table (R, K) -> table, or a copy with room for at least `needed` rows (doubling keeps appends O(1))
    R, K = table.shape
    if needed <= R:
        return table
    bigger = np.empty((max(needed, 2 * R), K), table.dtype)
    bigger[:R] = table
    return bigger


@njit(cache=True)
def _outranks(heap, i, j):
    # heap (H, 3) rows (priority, tie-break, payload): does entry i pop before entry j?
    # The larger priority first, then the larger tie-break.
    return heap[i, 0] > heap[j, 0] or (heap[i, 0] == heap[j, 0] and heap[i, 1] > heap[j, 1])


@njit(cache=True)
def _swap_rows(heap, i, j):
    for k in range(heap.shape[1]):
        heap[i, k], heap[j, k] = heap[j, k], heap[i, k]


@njit(cache=True)
def _heap_push(heap, size, priority, tie_break, payload):
    # heap (H, 3) with H > size, a max-heap on (priority, tie-break) -> new size
    heap[size, 0], heap[size, 1], heap[size, 2] = priority, tie_break, payload
    i = size
    while i > 0:
        parent = (i - 1) // 2
        if not _outranks(heap, i, parent):
            break
        _swap_rows(heap, i, parent)
        i = parent
    return size + 1


@njit(cache=True)
def _heap_pop(heap, size):
    # heap (H, 3) -> new size; the removed top entry is left in row `new size`
    size -= 1
    _swap_rows(heap, 0, size)
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and _outranks(heap, child + 1, child):
            child += 1
        if not _outranks(heap, child, i):
            break
        _swap_rows(heap, i, child)
        i = child
    return size


@njit(cache=True)
def _pair_key(left, right):
    return (np.int64(left) << 32) | np.int64(right)


@njit(cache=True)
def _add_pair(pair_index, pairs, occurrences, sizes, left, right, count, position):
    # pairs (P, 4), occurrences (O, 2), both with room for one more row -> pair row
    # Counts `count` more of pair (left, right), one occurrence of which starts at `position`.
    key = _pair_key(left, right)
    if key in pair_index:
        pair = pair_index[key]
    else:
        pair = sizes[N_PAIRS]
        sizes[N_PAIRS] += 1
        pair_index[key] = pair
        pairs[pair, KEY] = key
        pairs[pair, COUNT] = 0
        pairs[pair, HEAD] = -1
        pairs[pair, TOUCHED] = -1
    pairs[pair, COUNT] += count
    slot = sizes[N_OCCURRENCES]
    sizes[N_OCCURRENCES] += 1
    occurrences[slot, POSITION] = position
    occurrences[slot, NEXT] = pairs[pair, HEAD]
    pairs[pair, HEAD] = slot
    return pair


@njit(cache=True)
def _mark_touched(pairs, touched, n_touched, pair, stamp):
    # pairs (P, 4), touched (n,) -> new n_touched; lists `pair` once per merge (`stamp`)
    if pairs[pair, TOUCHED] != stamp:
        pairs[pair, TOUCHED] = stamp
        touched[n_touched] = pair
        n_touched += 1
    return n_touched


@njit(cache=True)
def _live_positions(pairs, occurrences, pair, left, right, symbols, next_pos):
    # -> (n,) sorted positions where pair (left, right) still starts. The occurrence list also
    # holds stale entries (neighbours merged since); sorting gives the left-to-right order that
    # resolves overlaps such as "aaa" the way the encoder does.
    n = 0
    slot = pairs[pair, HEAD]
    while slot >= 0:
        n += 1
        slot = occurrences[slot, NEXT]
    positions = np.empty(n, np.int64)
    n = 0
    slot = pairs[pair, HEAD]
    while slot >= 0:
        p = occurrences[slot, POSITION]
        q = next_pos[p]
        if symbols[p] == left and q >= 0 and symbols[q] == right:
            positions[n] = p
            n += 1
        slot = occurrences[slot, NEXT]
    return np.sort(positions[:n])


@njit(cache=True)
def _spell(trie_child, sizes, node, token, token_parts):
    # token_parts (V, 2) -> trie node reached from `node` along `token`'s bytes (missing nodes added).
    # The trie of token spellings detects a pair whose bytes equal an existing token's.
    pending = [token]
    while len(pending) > 0:
        t = pending.pop()
        if t < 256:
            edge = node * 256 + t
            if edge not in trie_child:
                trie_child[edge] = sizes[N_NODES]
                sizes[N_NODES] += 1
            node = trie_child[edge]
        else:
            pending.append(token_parts[t, 1])
            pending.append(token_parts[t, 0])
    return node


@njit(nogil=True, cache=True)
def learn_merges(symbols, word_offsets, word_counts, n_new_tokens, progress):
    # symbols (L,) int32: bytes of every distinct word end to end; overwritten with merged ids
    #   (-1 where a symbol was absorbed by its left neighbour)
    # word_offsets (W+1,) int64: word w is symbols[word_offsets[w]:word_offsets[w+1]]
    # word_counts (W,) int64: occurrences of each word in the corpus
    # progress (1,) int64: tokens learned so far, read by a watcher thread
    # -> merges (M, 2) int64, M <= n_new_tokens: the pair merged at each rank
    L = symbols.shape[0]
    W = word_counts.shape[0]
    next_pos = np.empty(L, np.int64)
    prev_pos = np.empty(L, np.int64)
    position_count = np.empty(L, np.int64)
    for w in range(W):
        start, end = word_offsets[w], word_offsets[w + 1]
        for p in range(start, end):
            prev_pos[p] = p - 1 if p > start else -1
            next_pos[p] = p + 1 if p + 1 < end else -1
            position_count[p] = word_counts[w]

    pair_index = Dict.empty(key_type=types.int64, value_type=types.int64)
    n_adjacent = max(L - W, 1)
    pairs = np.empty((n_adjacent, 4), np.int64)
    occurrences = np.empty((n_adjacent, 2), np.int64)
    sizes = np.zeros(3, np.int64)
    for p in range(L):
        if next_pos[p] >= 0:
            _add_pair(pair_index, pairs, occurrences, sizes, symbols[p], symbols[next_pos[p]], position_count[p], p)
    # Heap rows (count, -pair key, pair): the most frequent pair first, ties to the smaller pair
    # key, so training is deterministic.
    heap = np.empty((max(sizes[N_PAIRS], 1), 3), np.int64)
    heap_size = 0
    for pair in range(sizes[N_PAIRS]):
        heap_size = _heap_push(heap, heap_size, pairs[pair, COUNT], -pairs[pair, KEY], pair)

    V = 256 + n_new_tokens
    trie_child = Dict.empty(key_type=types.int64, value_type=types.int64)
    node_token = Dict.empty(key_type=types.int64, value_type=types.int64)
    token_node = np.empty(V, np.int64)
    token_parts = np.empty((V, 2), np.int64)
    sizes[N_NODES] = 1  # node 0 is the root: the empty string
    for b in range(256):
        token_node[b] = _spell(trie_child, sizes, 0, b, token_parts)
        node_token[token_node[b]] = b

    merges = np.empty((n_new_tokens, 2), np.int64)
    n_merges = 0
    n_tokens = 256
    while n_tokens < V and heap_size > 0:
        heap_size = _heap_pop(heap, heap_size)
        count, pair = heap[heap_size, 0], heap[heap_size, 2]
        current = pairs[pair, COUNT]
        if count != current:  # stale entry: the pair lost occurrences since it was pushed
            if 0 < current < count:
                heap_size = _heap_push(heap, heap_size, current, -pairs[pair, KEY], pair)
            continue
        left, right = pairs[pair, KEY] >> 32, pairs[pair, KEY] & 0xFFFFFFFF

        node = _spell(trie_child, sizes, token_node[left], right, token_parts)
        if node in node_token:
            # The pair spells an existing token (reached through other pairs): it is never merged,
            # so each byte string keeps one id. A count <= 0 keeps it out of the heap for good.
            pairs[pair, COUNT] = 0
            continue
        token = n_tokens
        n_tokens += 1
        node_token[node] = token
        token_node[token] = node
        token_parts[token, 0], token_parts[token, 1] = left, right
        merges[n_merges, 0], merges[n_merges, 1] = left, right
        n_merges += 1

        positions = _live_positions(pairs, occurrences, pair, left, right, symbols, next_pos)
        # Each merged position creates at most two pairs: make room before touching the tables.
        pairs = _grow_rows(pairs, sizes[N_PAIRS] + 2 * positions.shape[0])
        occurrences = _grow_rows(occurrences, sizes[N_OCCURRENCES] + 2 * positions.shape[0])
        touched = np.empty(2 * positions.shape[0], np.int64)
        n_touched = 0
        for p in positions:
            q = next_pos[p]
            if symbols[p] != left or q < 0 or symbols[q] != right:
                continue  # absorbed by the merge just left of it (overlapping run like "aaa")
            c = position_count[p]
            before, after = prev_pos[p], next_pos[q]
            if before >= 0:
                pairs[pair_index[_pair_key(symbols[before], left)], COUNT] -= c
                created = _add_pair(pair_index, pairs, occurrences, sizes, symbols[before], token, c, before)
                n_touched = _mark_touched(pairs, touched, n_touched, created, n_merges)
            if after >= 0:
                pairs[pair_index[_pair_key(right, symbols[after])], COUNT] -= c
                created = _add_pair(pair_index, pairs, occurrences, sizes, token, symbols[after], c, p)
                n_touched = _mark_touched(pairs, touched, n_touched, created, n_merges)
            symbols[p] = token
            symbols[q] = -1
            next_pos[p] = after
            if after >= 0:
                prev_pos[after] = p
        pairs[pair, COUNT] = 0

        # Only pairs that gained occurrences need a fresh heap entry; those that lost some are
        # corrected lazily when their stale entry reaches the top.
        heap = _grow_rows(heap, heap_size + n_touched)
        for i in range(n_touched):
            if pairs[touched[i], COUNT] > 0:
                heap_size = _heap_push(heap, heap_size, pairs[touched[i], COUNT], -pairs[touched[i], KEY], touched[i])
        progress[0] = n_tokens - 256
    return merges[:n_merges]


@njit(cache=True)
def _merge_index(pair_keys, left, right):
    # pair_keys (P,) sorted -> index of merge (left, right) in pair_keys, or -1
    key = _pair_key(left, right)
    i = np.searchsorted(pair_keys, key)
    if i < pair_keys.shape[0] and pair_keys[i] == key:
        return i
    return -1


@njit(cache=True)
def _merge_rank(pair_keys, pair_ranks, left, right):
    # pair_keys (P,) sorted, pair_ranks (P,) -> rank of merge (left, right), or -1
    i = _merge_index(pair_keys, left, right)
    return pair_ranks[i] if i >= 0 else -1


@njit(cache=True)
def apply_merges(symbols, word_offsets, pair_keys, pair_ranks):
    # symbols (L,) int32: bytes of the words end to end; rewritten so word w's token ids start at
    #   word_offsets[w]
    # word_offsets (W+1,) int64; pair_keys (P,) int64 sorted; pair_ranks (P,) int64 aligned with them
    # -> lengths (W,) int64: the number of tokens of each word
    # Merges the lowest-rank pair present, all its occurrences left to right, until none applies:
    # GPT-2's encoder, and Hugging Face's BPE model when no two merges spell the same token.
    W = word_offsets.shape[0] - 1
    lengths = np.empty(W, np.int64)
    for w in range(W):
        start = word_offsets[w]
        n = word_offsets[w + 1] - start
        while n > 1:
            best_rank, best_at = -1, -1
            for i in range(start, start + n - 1):
                rank = _merge_rank(pair_keys, pair_ranks, symbols[i], symbols[i + 1])
                if rank >= 0 and (best_rank < 0 or rank < best_rank):
                    best_rank, best_at = rank, i
            if best_rank < 0:
                break
            left, right, merged = symbols[best_at], symbols[best_at + 1], 256 + best_rank
            kept, i = start, start
            while i < start + n:
                if i + 1 < start + n and symbols[i] == left and symbols[i + 1] == right:
                    symbols[kept] = merged
                    i += 2
                else:
                    symbols[kept] = symbols[i]
                    i += 1
                kept += 1
            n = kept - start
        lengths[w] = n
    return lengths


@njit(cache=True)
def apply_merges_queued(symbols, word_offsets, pair_keys, pair_ranks, merged_ids):
    # symbols (L,) int32: initial token ids of the words end to end; rewritten so word w's token
    #   ids start at word_offsets[w]
    # word_offsets (W+1,) int64; pair_keys (P,) int64 sorted; pair_ranks (P,), merged_ids (P,) int64
    #   aligned with them: merge (left, right) has rank pair_ranks[i] and makes token merged_ids[i]
    # -> lengths (W,) int64: the number of tokens of each word
    # Hugging Face's BPE exactly (Word::merge_all): candidate merges wait in a min-queue on
    # (rank, position); a popped one is skipped if its left symbol was absorbed, or if the pair
    # now at its position makes a different token. When two merges spell the same token this
    # can differ from `apply_merges`' strict rank order, and Hugging Face's result is the one kept.
    W = word_offsets.shape[0] - 1
    lengths = np.empty(W, np.int64)
    longest = 0
    for w in range(W):
        longest = max(longest, word_offsets[w + 1] - word_offsets[w])
    # Queue rows (-rank, -position, new id) in a max-heap: the smallest (rank, position) first.
    queue = np.empty((3 * longest + 1, 3), np.int64)  # n - 1 initial entries, at most 2 per merge
    token = np.empty(longest, np.int64)
    prev = np.empty(longest, np.int64)
    next_ = np.empty(longest, np.int64)
    alive = np.empty(longest, np.bool_)
    for w in range(W):
        start = word_offsets[w]
        n = word_offsets[w + 1] - start
        size = 0
        for i in range(n):
            token[i], prev[i], next_[i], alive[i] = symbols[start + i], i - 1, i + 1, True
        if n > 0:
            next_[n - 1] = -1
        for i in range(n - 1):
            m = _merge_index(pair_keys, token[i], token[i + 1])
            if m >= 0:
                size = _heap_push(queue, size, -pair_ranks[m], -i, merged_ids[m])
        while size > 0:
            size = _heap_pop(queue, size)
            pos, new_id = -queue[size, 1], queue[size, 2]
            right = next_[pos]
            if not alive[pos] or right == -1:
                continue
            m = _merge_index(pair_keys, token[pos], token[right])
            if m < 0 or merged_ids[m] != new_id:
                continue  # a stale entry: the pair at pos changed since it was queued
            token[pos], alive[right], next_[pos] = new_id, False, next_[right]
            if next_[pos] != -1:
                prev[next_[pos]] = pos
            if prev[pos] >= 0:
                m = _merge_index(pair_keys, token[prev[pos]], token[pos])
                if m >= 0:
                    size = _heap_push(queue, size, -pair_ranks[m], -prev[pos], merged_ids[m])
            if next_[pos] != -1:
                m = _merge_index(pair_keys, token[pos], token[next_[pos]])
                if m >= 0:
                    size = _heap_push(queue, size, -pair_ranks[m], -pos, merged_ids[m])
        kept, i = 0, 0
        while n > 0 and i != -1:
            symbols[start + kept] = token[i]
            kept += 1
            i = next_[i]
        lengths[w] = kept
    return lengths
