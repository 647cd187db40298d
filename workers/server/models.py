"""Tensor declarations of the worker's Triton models (docs/worker-protocol.md is the reference)."""

from __future__ import annotations

import numpy as np
from pytriton.model_config import Tensor

from app.protocol import worker_api as W

BYTES = np.bytes_


def _t(name: str, dtype: type, optional: bool = False) -> Tensor:
    return Tensor(name=name, dtype=dtype, shape=(-1,), optional=optional)


PREFILL_INPUTS = [
    _t(W.P_BATCH_ID, BYTES),
    _t(W.P_EPOCH, BYTES, optional=True),
    _t(W.P_REQUEST_IDS, BYTES),
    _t(W.P_INPUT_IDS, np.int32, optional=True),
    _t(W.P_BLOCK_KEYS, np.uint64, optional=True),
    _t(W.P_INPUT_LENGTHS, np.int32),
    _t(W.P_TEMPERATURE, np.float64, optional=True),
    _t(W.P_TOP_P, np.float64, optional=True),
    _t(W.P_SEED, np.int64, optional=True),
]
PREFILL_OUTPUTS = [
    _t(W.P_EVENT, BYTES),
    _t(W.P_BATCH_ID, BYTES),
    _t(W.P_EPOCH, BYTES),
    _t(W.P_QUEUE_POSITION, np.int32),
    _t(W.P_REQUEST_IDS, BYTES),
    _t(W.P_STATUS, BYTES),
    _t(W.P_FIRST_TOKEN, np.int32),
    _t(W.P_CACHED_TOKENS, np.int32),
    _t(W.P_INPUT_TOKENS, np.int32),
    _t(W.P_START_MS, np.float64),
    _t(W.P_END_MS, np.float64),
    _t(W.P_KV_EXPIRY_MS, np.float64),
    _t(W.P_SEQ, np.int64),
    _t(W.P_ERROR, BYTES),
    _t(W.P_FINAL, np.int32),
]
DECODE_INPUTS = [
    _t(W.D_REQUEST_ID, BYTES),
    _t(W.D_EPOCH, BYTES, optional=True),
    _t(W.D_INPUT_TOKENS, np.int32),
    _t(W.D_MAX_NEW_TOKENS, np.int32),
    _t(W.D_FIRST_INDEX, np.int32, optional=True),
    _t(W.D_KV_WORKER, BYTES, optional=True),
    _t(W.D_KV_EPOCH, BYTES, optional=True),
    _t(W.D_TEMPERATURE, np.float64, optional=True),
    _t(W.D_TOP_P, np.float64, optional=True),
    _t(W.D_SEED, np.int64, optional=True),
    _t(W.D_BLOCK_KEYS, np.uint64, optional=True),
    _t(W.D_BLOCK_SIZE, np.int32, optional=True),
]
DECODE_OUTPUTS = [
    _t(W.D_EVENT, BYTES),
    _t(W.D_TOKENS, np.int32),
    _t(W.D_FIRST_INDEX, np.int32),
    _t(W.D_T_FIRST_MS, np.float64),
    _t(W.D_T_LAST_MS, np.float64),
    _t(W.D_FINISH_REASON, BYTES),
    _t(W.D_GENERATED, np.int32),
    _t(W.D_ERROR, BYTES),
]
CONTROL_INPUTS = [_t(W.C_REQUEST, BYTES)]
CONTROL_OUTPUTS = [_t(W.C_RESPONSE, BYTES)]
