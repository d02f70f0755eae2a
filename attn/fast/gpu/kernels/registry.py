"""Every kernel once: its name, its CUDA source and its NumPy twin (:data:`KERNELS`), and the one
module NVRTC compiles from them (:data:`SOURCE`, :data:`NAME_EXPRESSIONS`, :data:`OPTIONS`): the
device functions several kernels call (:data:`PRELUDE`), then the kernels family by family. The
source text is kept as it is: CuPy keys its cache of compiled modules on it, and NVRTC's errors
name its lines."""
from __future__ import annotations

from . import adam, bf16, column_sums, common, decode, dropout, flash, flash_mma, gemm, later, layer_norm, loss, relu, softmax

#: The device functions that several kernels call (``block_sum``, ``block_max``, ``normalise_row``,
#: ``flash_allowed``).
PRELUDE = common.HELPERS + flash.ALLOWED

#: Every kernel of the module: name -> (its CUDA source, its NumPy twin), in the source's order.
KERNELS = {
    "softmax0_fwd": (softmax.SOFTMAX0_FWD, softmax.softmax0_fwd_np),
    "softmax0_bwd": (softmax.SOFTMAX0_BWD, softmax.softmax0_bwd_np),
    "layer_norm_fwd": (layer_norm.LAYER_NORM_FWD, layer_norm.layer_norm_fwd_np),
    "layer_norm_bwd": (layer_norm.LAYER_NORM_BWD, layer_norm.layer_norm_bwd_np),
    "column_sums": (column_sums.COLUMN_SUMS, column_sums.column_sums_np),
    "cross_entropy_fwd_bwd": (loss.CROSS_ENTROPY, loss.cross_entropy_fwd_bwd_np),
    "dropout_fwd": (dropout.DROPOUT_FWD, dropout.dropout_fwd_np),
    "dropout_bwd": (dropout.DROPOUT_BWD, dropout.dropout_bwd_np),
    "dropout_hash": (dropout.DROPOUT_HASH, dropout.dropout_hash_np),
    "residual_ln_fwd": (layer_norm.RESIDUAL_LN_FWD, layer_norm.residual_ln_fwd_np),
    "layer_norm_bwd_drop": (layer_norm.LAYER_NORM_BWD_DROP, layer_norm.layer_norm_bwd_drop_np),
    "bias_relu_drop": (relu.BIAS_RELU_DROP, relu.bias_relu_drop_np),
    "relu_bwd": (relu.RELU_BWD, relu.relu_bwd_np),
    "rms_norm_fwd": (later.RMS_NORM_FWD, later.rms_norm_fwd_np),
    "rms_norm_bwd": (later.RMS_NORM_BWD, later.rms_norm_bwd_np),
    "rope_rotate": (later.ROPE_ROTATE, later.rope_rotate_np),
    "swiglu_fwd": (later.SWIGLU_FWD, later.swiglu_fwd_np),
    "swiglu_bwd": (later.SWIGLU_BWD, later.swiglu_bwd_np),
    "adam": (adam.ADAM, adam.adam_np),
    "sumsq_partial": (adam.SUMSQ_PARTIAL, adam.sumsq_partial_np),
    "adam_flat": (adam.ADAM_FLAT, adam.adam_flat_np),
    "decode_embed": (decode.DECODE_EMBED, decode.decode_embed_np),
    "add_norm": (decode.ADD_NORM, decode.add_norm_np),
    "one_query_attention": (decode.ONE_QUERY_ATTENTION, decode.one_query_attention_np),
    "log_softmax_rows": (decode.LOG_SOFTMAX_ROWS, decode.log_softmax_rows_np),
    "greedy_pick": (decode.GREEDY_PICK, decode.greedy_pick_np),
    "beam_candidates": (decode.BEAM_CANDIDATES, decode.beam_candidates_np),
    "gather_prefix": (decode.GATHER_PREFIX, decode.gather_prefix_np),
    "gemm_pointers": (gemm.GEMM_POINTERS, gemm.gemm_pointers_np),
    "round_bf16": (bf16.ROUND_BF16, bf16.round_bf16_np),
    "round_bf16_gather": (bf16.ROUND_BF16_GATHER, bf16.round_bf16_gather_np),
    "flash_fwd": (flash.FLASH_FWD, flash.flash_fwd_np),
    "flash_bwd_prep": (flash.FLASH_BWD_PREP, flash.flash_bwd_prep_np),
    "flash_bwd_kv": (flash.FLASH_BWD_KV, flash.flash_bwd_kv_np),
    "flash_bwd_q": (flash.FLASH_BWD_Q, flash.flash_bwd_q_np),
}

#: The CUDA source of the one ``RawModule``: the prelude, then every kernel's source.
SOURCE = PRELUDE + "".join(source for source, _ in KERNELS.values())
#: Every kernel of :data:`SOURCE` and of the tensor-core module (:mod:`.flash_mma`, compiled on its own:
#: it needs compute capability 8.0) and its NumPy twin (what the test suite's CuPy stand-in runs).
NUMPY_TWINS = {name: twin for name, (_, twin) in {**KERNELS, **flash_mma.KERNELS}.items()}
#: The C type of each dtype the kernels are instantiated for.
CTYPES = {"float32": "float", "float64": "double"}
#: The tiled attention's kernels, compiled for each head size of :data:`.flash.HEAD_SIZES` (float32).
HEADED = ("flash_fwd", "flash_bwd_kv", "flash_bwd_q")
#: The template instantiations the module is compiled with (NVRTC's name expressions): ``name<T>``,
#: or ``name<T, DH>`` for :data:`HEADED` (float32 at every head size of :data:`.flash.HEAD_SIZES`,
#: float64 at 0, the head size read at run time).
NAME_EXPRESSIONS = tuple(f"{k}<{t}>" if k not in HEADED else f"{k}<{t}, {dh}>" for k in KERNELS
                         for t in CTYPES.values()
                         for dh in (flash.HEAD_SIZES if k in HEADED and t == "float" else (0,)))
#: Options for NVRTC.
OPTIONS = ("-std=c++14",)
