"""Inputs for every scenario: generated from the recipe's specs, or real text through the model's tokenizer.

They are built once per run from the recipe's seed, so every stage sees exactly the same arrays: the benchmark
cycles through every sample of a scenario (parent and child on the same sample at the same call), and all samples
feed the accuracy comparison. A scenario with `padding: longest` takes sentences at their natural lengths (each
batch padded to its longest sentence), so its latency is that of the mix a service really sees; its lengths are
summarized in the report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.errors import InputError
from optimizer.recipe.schema import HFFolderSource, InputSpec, Recipe, Scenario

Feed = dict[str, np.ndarray]


@dataclass
class ScenarioFeeds:
    scenario: Scenario
    samples: list[Feed]

    @property
    def timing(self) -> Feed:
        """One representative sample (the first): for probes and checks that need a single input."""
        return self.samples[0]

    def lengths(self) -> dict[str, Any] | None:
        """Tokens per sample (the sequence dim of the mask or the first input): min / median / max and the
        share of positions that are padding, or None for inputs without a sequence dim."""
        seqs, real, total = [], 0, 0
        for f in self.samples:
            name = next((n for n in f if "mask" in n and f[n].ndim == 2), next(iter(f)))
            a = f[name]
            if a.ndim != 2:
                return None
            seqs.append(a.shape[1])
            if "mask" in name:
                real += int(a.astype(bool).sum())
                total += a.size
        return {
            "padding": self.scenario.padding,
            "samples": len(seqs),
            "seq_min": int(min(seqs)),
            "seq_median": float(np.median(seqs)),
            "seq_max": int(max(seqs)),
            "padded_share": round(1 - real / total, 4) if total else None,
        }


@dataclass
class FeedSet:
    input_names: list[str]
    by_scenario: dict[str, ScenarioFeeds]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.by_scenario.values())


def _shape(spec: InputSpec, scenario: Scenario) -> tuple[int, ...]:
    bind = scenario.bindings()
    return tuple(bind[d] if isinstance(d, str) else d for d in spec.shape)


def _generate(spec: InputSpec, scenario: Scenario, rng: np.random.Generator) -> np.ndarray:
    shape = _shape(spec, scenario)
    dtype = np.dtype(spec.dtype)
    if spec.fill == "ones":
        return np.ones(shape, dtype)
    if spec.fill == "zeros":
        return np.zeros(shape, dtype)
    if np.issubdtype(dtype, np.integer):
        low, high = spec.range or (0, 1000)
        # The integers k with low <= k < high (int() truncated toward 0: [-0.5, 0.5) drew from an empty range)
        return rng.integers(math.ceil(low), math.ceil(high), size=shape).astype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    low, high = spec.range or (-1.0, 1.0)
    return rng.uniform(low, high, size=shape).astype(dtype)


def read_sentences(recipe: Recipe) -> list[str]:
    assert recipe.text is not None
    if recipe.text.sentences is not None:
        lines = recipe.text.sentences
    else:
        path = recipe.resolve(recipe.text.file or "")
        lines = path.read_text().splitlines()
    sentences = [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]
    if not sentences:
        raise InputError("text: no sentences found")
    return sentences


def _tokenizer(recipe: Recipe):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from optimizer.runtime.models import hf_folder

    if not isinstance(recipe.model, HFFolderSource):
        raise InputError("text: real-text inputs need a model source of type hf_folder (it has the tokenizer)")
    folder: Path = hf_folder(recipe.model, recipe)
    return AutoTokenizer.from_pretrained(str(folder))


TEXT_INPUTS = 3  # what a tokenizer returns when the recipe names no inputs: input_ids, attention_mask, token types


def sample_bytes(recipe: Recipe, scenario: Scenario) -> int:
    """The bytes of one sample's inputs in a scenario, from the shapes (text: [batch, seq] int64 per input), before
    anything is allocated."""
    if recipe.text is not None and not recipe.inputs:
        return TEXT_INPUTS * scenario.batch * scenario.seq * 8
    return sum(math.prod(_shape(spec, scenario)) * np.dtype(spec.dtype).itemsize for spec in recipe.inputs)


def available_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def _check_fits(recipe: Recipe, counts: dict[str, int]) -> None:
    """All the samples of every scenario are held for the whole run: refuse them, naming the largest scenario, when
    they would take more than half the memory available now (the rest is the models')."""
    sizes = {s.name: sample_bytes(recipe, s) * counts[s.name] for s in recipe.scenarios}
    total, room = sum(sizes.values()), available_bytes() // 2
    if total > room:
        i, largest = max(enumerate(recipe.scenarios), key=lambda x: sizes[x[1].name])
        where = f"scenarios[{i}].samples" if largest.samples else "accuracy.samples"
        raise InputError(
            f"{where}: the inputs of {counts[largest.name]} samples of scenario {largest.name!r} take "
            f"{sizes[largest.name] / 2**30:.3g} GiB ({total / 2**30:.3g} GiB for all scenarios), more than half the "
            f"{2 * room / 2**30:.3g} GiB available now; use fewer samples or smaller batch/seq"
        )


def build_feeds(recipe: Recipe, samples: int, per_scenario: bool = True) -> FeedSet:
    """`samples` feeds per scenario (or the scenario's own `samples` when per_scenario); text sentences are taken
    in order, so sample k differs from sample k+1. Inputs this machine cannot hold are one InputError, before
    they are allocated (or when an allocation fails all the same)."""
    if recipe.data_file:
        return _from_file(recipe, samples)
    counts = {s.name: (s.samples or samples) if per_scenario else samples for s in recipe.scenarios}
    _check_fits(recipe, counts)
    try:
        return _build(recipe, counts)
    except MemoryError as e:
        raise InputError(f"inputs: cannot allocate the scenarios' inputs ({type(e).__name__}: {e})") from None


def _build(recipe: Recipe, counts: dict[str, int]) -> FeedSet:
    rng = np.random.default_rng(recipe.seed)
    sentences = read_sentences(recipe) if recipe.text else []
    tokenizer = _tokenizer(recipe) if recipe.text else None
    names = [s.name for s in recipe.inputs]
    by_scenario: dict[str, ScenarioFeeds] = {}
    cursor = 0
    for scenario in recipe.scenarios:
        feeds: list[Feed] = []
        for _ in range(counts[scenario.name]):
            feed: Feed = {}
            if tokenizer is not None:
                batch = [sentences[(cursor + i) % len(sentences)] for i in range(scenario.batch)]
                cursor += scenario.batch
                enc = tokenizer(
                    batch, padding=scenario.padding, truncation=True, max_length=scenario.seq, return_tensors="np"
                )
                wanted = names or list(enc.keys())
                for name in wanted:
                    if name in enc:
                        feed[name] = np.asarray(enc[name]).astype(np.int64)
                if not names:
                    names = list(feed)
            # An input the tokenizer does not return is generated at the tokenized length: a natural-length
            # scenario tokenizes shorter than its `seq` (RoBERTa's token_type_ids took 128 against 12 tokens).
            tokenized = next((v.shape[1] for v in feed.values() if v.ndim == 2), None)
            generated_at = scenario.model_copy(update={"seq": tokenized}) if tokenized else scenario
            for spec in recipe.inputs:
                if spec.name not in feed:
                    feed[spec.name] = _generate(spec, generated_at, rng)
                else:
                    feed[spec.name] = feed[spec.name].astype(spec.dtype)
            feeds.append({n: feed[n] for n in names})
        by_scenario[scenario.name] = ScenarioFeeds(scenario, feeds)
    if not names:
        raise InputError("inputs: the recipe names no inputs (give `inputs` or `text`)")
    return FeedSet(names, by_scenario)


def _from_file(recipe: Recipe, samples: int) -> FeedSet:
    path = recipe.resolve(recipe.data_file or "")
    try:
        with np.load(path) as data:
            feed = {k: data[k] for k in data.files}
    except (OSError, ValueError) as e:
        raise InputError(f"data_file: cannot read {path} ({e})") from None
    names = [s.name for s in recipe.inputs] or list(feed)
    missing = [n for n in names if n not in feed]
    if missing:
        raise InputError(f"data_file: {path} has no arrays for {missing}")
    feed = {n: feed[n] for n in names}
    problem = data_problem(recipe, feed)
    if problem is not None:
        raise InputError(f"data_file: {path}: {problem}")
    return FeedSet(names, {s.name: ScenarioFeeds(s, [feed] * (s.samples or samples)) for s in recipe.scenarios})


def data_problem(recipe: Recipe, feed: Feed) -> str | None:
    """What is wrong with a data_file's arrays, else None: the one check of them, before anything runs. Each
    holds finite numbers; where the recipe declares the input, the array has its dtype and, under every scenario,
    its shape (the data is every sample of every scenario, so a batch-8 array under a batch-1 scenario would be
    timed and counted as one sample per call); where it does not, its first dim (its batch) is not 0."""
    specs = {s.name: s for s in recipe.inputs}
    for name, a in feed.items():
        spec = specs.get(name)
        if spec is None and a.ndim and a.shape[0] == 0:  # undeclared: its batch is its first dim
            return f"array {name!r} has shape {tuple(a.shape)}: a batch of 0 has nothing to time or compare"
        if spec is not None and a.dtype != np.dtype(spec.dtype):
            return f"array {name!r} is {a.dtype}, but inputs declares {name!r} as {spec.dtype}"
        if spec is not None:
            for scen in recipe.scenarios:
                want = _shape(spec, scen)
                if tuple(a.shape) != want:
                    return (f"array {name!r} has shape {tuple(a.shape)}, but scenario {scen.name!r} gives "
                            f"{name!r} the shape {want}: one data_file is every sample of every scenario, so "
                            "its shape must be theirs")
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            bad = int(np.count_nonzero(~np.isfinite(a)))
            return f"array {name!r} holds {bad} NaN or infinite values; every sample must be finite numbers"
    return None
