"""A FAKE stand-in for sglang, for draftfeed's tests only: it is not sglang.

sglang cannot be installed where draftfeed is built and tested (it needs CUDA kernels). This package has
the module paths and names draftfeed's sglang engine imports, with sglang 0.5.9's call signatures and
capture semantics, implemented on transformers (``AutoModelForCausalLM``, on CPU). It proves the adapter's
own logic (requests per row, position mapping, layer-id semantics, pool clearing, refusals), not that the
real sglang behaves as this fake does. Under tensor parallel (``ModelRunner(tp_size > 1)``) it joins a real gloo
group at ``tcp://127.0.0.1:nccl_port``, holds vocab shards of the embeddings and lm_head and runs collectives in
every forward, so ranks out of step fail; its decoder layers run whole, unsharded, on every rank (``_fake``'s
docstring says exactly what it copies). Everything lives in ``sglang._fake``; the other modules re-export.
"""

__version__ = "0.5.9"
