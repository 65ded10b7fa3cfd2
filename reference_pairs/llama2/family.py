"""The Llama 2 family: the llama3 family's model, weight table, node map and config mapping against
``transformers.LlamaForCausalLM``, with Llama 2's configs, faults and fields: Llama 2 is data."""

from __future__ import annotations

import dataclasses

from ..common.builders import pair_builder
from ..llama3.family import FAMILY as LLAMA3
from .configs import CONFIGS
from .faults import FAULTS
from .fields import FIELDS

FAMILY = dataclasses.replace(
    LLAMA3,
    name="llama2",
    configs=CONFIGS,
    faults=FAULTS,
    fields=FIELDS,
    ci_configs=("tiny",),
    real_configs=("7b-shape",),
)
build_pair = pair_builder(FAMILY)
