"""What the fast engine needs of a GPU, and what it does when a GPU refuses: ``kernels`` holds the
fused CUDA kernels (each beside its NumPy twin) and their launch code, ``cublas`` calls cuBLAS
through ``ctypes`` so that a captured stream can run the products, ``stepmem`` serves every array
a step makes from one slab at the same addresses every step, ``stepplan`` plans where in the slab
each array lies from the lifetimes a traced step recorded, ``graph`` captures a step as a CUDA
graph and replays it, ``probe`` tries each of these features on a tiny model in a child process,
and ``fallback`` switches off a feature whose probe fails, with one line naming it, so that a run
on a GPU always trains. On NumPy none of it runs: the step memory and the captured step stand
aside, and the model's pieces (:mod:`attn.fast.core`) use the NumPy operations."""
