"""Static KV cache as a stage of its own: the PyTorch generation loop over a preallocated cache.

It changes what every decode step costs (attention over the whole preallocated length, masked, instead of the
filled part; no reallocation as the cache grows) and it is what makes the decode step capturable by a CUDA
graph (optimizer/runtime/generation_static.py). Keeping it apart from cuda_graph means the cost or gain of the static
cache is attributed here and the gain of capture alone to the cuda_graph stage after it.
"""

from __future__ import annotations

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassResult
from optimizer.recipe.schema import SEQ2SEQ_TASKS


class StaticKVCacheConfig(PassConfig):
    pass


class StaticKVCachePass(Pass[StaticKVCacheConfig]):
    name = "static_kv_cache"
    summary = "PyTorch generation over a preallocated (static) KV cache; needed before cuda_graph on a decoder"
    Config = StaticKVCacheConfig
    consumes = frozenset({"torch"})
    handles_generation = True

    def skip_reason(self, artifact: Artifact, ctx: PassContext) -> str | None:
        reason = super().skip_reason(artifact, ctx)
        if reason:
            return reason
        if ctx.recipe.workload != "generation":
            return "a KV cache is a generation option; this recipe's workload is forward"
        if getattr(ctx.recipe.model, "task", None) in SEQ2SEQ_TASKS:
            return "built for decoders (causal-lm): encoder-decoder generation keeps transformers' dynamic cache"
        return None

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        from optimizer.runtime.generation import TorchGenerator
        from optimizer.runtime.generation_static import StaticCacheGenerator
        from optimizer.runtime.models import load_module

        out = artifact.with_runtime(kv_cache="static")
        # Checked on the CPU against the dynamic-cache loop before anything is timed: same tokens, close logits.
        prompt = next(iter(ctx.feeds)).timing["input_ids"]
        model = load_module(ctx.recipe)  # both loops read it, neither changes it
        expected = TorchGenerator(model, 1).generate(prompt, 8)
        static = StaticCacheGenerator(model, 1)
        check = ctx.check(expected, static.generate(prompt, 8))
        if check["token_agreement"] < 1.0:
            raise PassError(f"the static-cache loop disagrees with the dynamic one: {check}")
        ops, reads = static.step_host_reads(prompt)
        capturable = {
            "decode_step_ops": ops,
            "host_reads": reads,
            "capturable": not reads,  # no op reads a value back to the host: a CUDA graph can hold the step
        }
        return PassResult(out, modified=True, notes={"kv_cache": "static", "check": check, **capturable})
