"""The objects an exercise gives to the learner's functions, built in the child where the
exercise's manifest lets its modules load (the decoding exercise's model)."""
from __future__ import annotations


def decoding_model(seed: int, dtype="float64"):
    """The fixed small model the decoding exercise is graded on: 6 ids (0 PAD, 1 BOS, 2 EOS),
    d_model 8, 2 heads, one layer each side, weights drawn from ``seed`` and scaled up so
    that its distributions are peaked and EOS comes at different steps."""
    from attn.model import Transformer, TransformerConfig
    cfg = TransformerConfig(vocab_size=6, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1, n_decoder_layers=1,
                            dropout=0.0, max_len=32)
    m = Transformer(cfg, seed=seed, dtype=dtype)
    m.params = {k: v * v.dtype.type(3.0) if k == "embedding.weight" else v for k, v in m.params.items()}
    return m
