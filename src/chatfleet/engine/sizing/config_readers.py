"""The config readers by ``model_type``, and a model's shape from its config.json.

``CONFIG_READERS`` lists every built-in reader in one place; ``register_config_reader`` adds
one (a new architecture, or a test's toy). ``model_shape`` picks the reader for a config: its
own ``model_type``, else its ``text_config``'s with the vision/audio towers estimated (see
``tensors.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chatfleet.engine.sizing.gemma4_reader import read_gemma4
from chatfleet.engine.sizing.readers import read_gemma3_text, read_llama, read_qwen2, read_qwen3, read_qwen3_moe
from chatfleet.engine.sizing.tensors import TOWER_CLASSES, ConfigReader, ModelShape, encoder_estimate
from chatfleet.errors import ConfigError

CONFIG_READERS: dict[str, ConfigReader] = {
    "qwen3": read_qwen3,
    "qwen2": read_qwen2,
    "llama": read_llama,
    "mistral": read_llama,
    "qwen3_moe": read_qwen3_moe,
    "gemma3_text": read_gemma3_text,
    "gemma4": read_gemma4,
    "gemma4_text": read_gemma4,
}


def register_config_reader(reader: ConfigReader, *model_types: str) -> ConfigReader:
    """List ``reader`` under the given ``model_type`` names (a later reader replaces an earlier one)."""
    for name in model_types:
        CONFIG_READERS[name] = reader
    return reader


def _reader(model_type: str) -> ConfigReader:
    try:
        return CONFIG_READERS[model_type]
    except KeyError:
        raise ConfigError(f"no memory arithmetic for model type {model_type!r}; known: "
                          f"{', '.join(sorted(CONFIG_READERS))}") from None


def has_config_reader(config: Mapping[str, Any]) -> bool:
    """Whether the memory arithmetic knows this config's model type (or its text model's)."""
    text = config.get("text_config")
    return (config.get("model_type") in CONFIG_READERS
            or (isinstance(text, Mapping) and text.get("model_type") in CONFIG_READERS))


def model_shape(config: Mapping[str, Any], block_size: int = 16) -> ModelShape:
    """The tensors and KV spec of the model a config.json describes (towers included, see module doc)."""
    model_type = config.get("model_type") or ""
    if model_type in CONFIG_READERS:
        return CONFIG_READERS[model_type](config, block_size)
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        return _reader(model_type)(config, block_size)  # raises: unknown type
    merged = dict(text)
    for key in ("tie_word_embeddings", "quantization_config"):
        if key in config and key not in merged:
            merged[key] = config[key]
    inner = _reader(merged.get("model_type") or "")(merged, block_size)
    towers = [t for cls in TOWER_CLASSES if isinstance(config.get(f"{cls}_config"), Mapping)
              for t in encoder_estimate(config[f"{cls}_config"], cls, merged.get("hidden_size", 0))]
    notes = inner.notes + tuple(f"{cls} tower estimated as a ViT-style encoder" for cls in TOWER_CLASSES
                                if isinstance(config.get(f"{cls}_config"), Mapping))
    return ModelShape(model_type, inner.tensors + tuple(towers), inner.kv_spec, inner.max_position_embeddings,
                      inner.tie_word_embeddings, notes)
