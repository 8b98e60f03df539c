"""The two graphs of a generation export (prefill + decode) as one artifact over one weights file: shared by the
decoder and encoder-decoder exports."""

from __future__ import annotations

from optimizer.core.artifact import Artifact
from optimizer.core.pass_base import PassContext


def graph_pair(artifact: Artifact, ctx: PassContext, layers: int) -> Artifact:
    """The generation artifact of the two exported graphs (prefill.tmp.onnx, decode.tmp.onnx in the stage folder),
    saved over one weights file (onnx_io.save_shared) as prefill.onnx + decode.onnx, the temporary files removed."""
    from optimizer.runtime import onnx_io

    tmp = {part: ctx.stage_dir / f"{part}.tmp.onnx" for part in ("prefill", "decode")}
    shared = onnx_io.save_shared({f"{part}.onnx": path for part, path in tmp.items()}, ctx.stage_dir)
    for path in tmp.values():  # with the side files the exporter wrote for graphs past 2 GB (name.tmp.onnx.data)
        for f in ctx.stage_dir.glob(path.name + "*"):
            f.unlink()
    return artifact.derive(
        kind="onnx",
        path=ctx.stage_dir / "prefill.onnx",
        runtime={"graph_optimization_level": "disable_all"},
        exporter="dynamo",
        external_data=shared,
        decode="decode.onnx",
        decode_external_data=[],
        layers=layers,
        output_names=["generation"],
    )

