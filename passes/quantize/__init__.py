"""The `quantize` pass (int8_dynamic, int8_static QDQ, fp16, weight_only, and hybrid under an accuracy budget), one
job per module: quantize_pass.QuantizePass is the pass (core.registry names it there), config.py its settings and
notes, modes.py and weight_only.py the plain modes, hybrid.py the per-node search, run by hybrid_cpu.py on cpu
targets and by hybrid_gpu.py on GPU ones. The package itself imports nothing.
"""
