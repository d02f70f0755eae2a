"""A learner's answer to lessons/exercises/bpe.py, written from its docstring (the plain
algorithm: recount every pair after every merge): attn-check must pass it."""
from attn.bpe import merge_symbols, symbols_of


def learn_merges(token_counts, num_merges):
    words = [(symbols_of(w), n) for w, n in token_counts.items()]
    merges = []
    while len(merges) < num_merges:
        counts = {}
        for symbols, n in words:
            for pair in zip(symbols, symbols[1:]):
                counts[pair] = counts.get(pair, 0) + n
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        if counts[best] < 2:
            break
        merges.append(best)
        a, b = best
        new_words = []
        for symbols, n in words:
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == a and symbols[i + 1] == b:
                    out.append(merge_symbols(a, b))
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            new_words.append((out, n))
        words = new_words
    return merges
