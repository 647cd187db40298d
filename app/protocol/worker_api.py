"""Tensor names and control-message fields of the worker contract (docs/worker-protocol.md).

One module so the gateway's client and the workers' models can never disagree on a name.
"""

from __future__ import annotations

from typing import Final

PREFILL_MODEL: Final = "prefill"
DECODE_MODEL: Final = "decode"
CONTROL_MODEL: Final = "control"

# prefill inputs
P_BATCH_ID: Final = "batch_id"  # BYTES [1]
P_EPOCH: Final = "epoch"  # BYTES [1], expected worker epoch ("" = do not check; tools only)
P_REQUEST_IDS: Final = "request_ids"  # BYTES [n]
P_INPUT_IDS: Final = "input_ids"  # INT32 [sum(lengths)], every prompt concatenated (or P_BLOCK_KEYS)
# UINT64 [sum(lengths // block_size)]: every prompt's full-block keys, concatenated, instead of the
# ids, for an engine that does not need them (control `describe` says which; docs §4.1)
P_BLOCK_KEYS: Final = "block_keys"
P_INPUT_LENGTHS: Final = "input_lengths"  # INT32 [n]
# optional sampling fields, one per prompt (a real engine uses them; the simulated one ignores them)
P_TEMPERATURE: Final = "temperature"  # FP64 [n], 0 = greedy
P_TOP_P: Final = "top_p"  # FP64 [n], 1 = no nucleus cut
P_SEED: Final = "seed"  # INT64 [n], -1 = the engine picks one

# prefill outputs (every event carries all of them; arrays empty where they do not apply)
P_EVENT: Final = "event"  # BYTES [1]: accepted | results | final | error
P_QUEUE_POSITION: Final = "queue_position"  # INT32 [1]
P_STATUS: Final = "status"  # BYTES [m]
P_FIRST_TOKEN: Final = "first_token"  # INT32 [m]
P_CACHED_TOKENS: Final = "cached_tokens"  # INT32 [m]
P_INPUT_TOKENS: Final = "input_tokens"  # INT32 [m]
P_START_MS: Final = "start_ms"  # FP64 [m] modelled
P_END_MS: Final = "end_ms"  # FP64 [m] modelled
P_KV_EXPIRY_MS: Final = "kv_expiry_ms"  # FP64 [m] modelled
P_SEQ: Final = "seq"  # INT64 [m]
P_ERROR: Final = "error"  # BYTES [m] (for event=error: [1], the reason)
P_FINAL: Final = "final"  # INT32 [1] on a `results` event that is also the batch's `final`

# decode inputs
D_REQUEST_ID: Final = "request_id"  # BYTES [1]
D_EPOCH: Final = "epoch"  # BYTES [1]
D_INPUT_TOKENS: Final = "input_tokens"  # INT32 [1]
D_MAX_NEW_TOKENS: Final = "max_new_tokens"  # INT32 [1] tokens this engine generates
D_FIRST_INDEX: Final = "first_index"  # INT32 [1] optional, default 1 (token 0 came from prefill)
D_KV_WORKER: Final = "kv_worker"  # BYTES [1] optional, prefill worker host:grpc_port holding the KV
D_KV_EPOCH: Final = "kv_epoch"  # BYTES [1] optional, that worker's epoch
# optional: override the sampling fields the KV frame carries from prefill (same meaning as P_*)
D_TEMPERATURE: Final = "temperature"  # FP64 [1]
D_TOP_P: Final = "top_p"  # FP64 [1]
D_SEED: Final = "seed"  # INT64 [1]
# optional: the prompt's full-block keys (UINT64 [n]) of D_BLOCK_SIZE (INT32 [1]) tokens each: the
# engine holds a block its running sequences share once (paged KV; FLEXLB_DECODE_SHARED_PREFIX)
D_BLOCK_KEYS: Final = "block_keys"
D_BLOCK_SIZE: Final = "block_size"

# decode outputs
D_EVENT: Final = "event"  # BYTES [1]: tokens | finish
D_TOKENS: Final = "tokens"  # INT32 [k]
D_T_FIRST_MS: Final = "t_first_ms"  # FP64 [1]
D_T_LAST_MS: Final = "t_last_ms"  # FP64 [1]
D_FINISH_REASON: Final = "finish_reason"  # BYTES [1]
D_GENERATED: Final = "generated"  # INT32 [1]
D_ERROR: Final = "error"  # BYTES [1]

# control
C_REQUEST: Final = "request"  # BYTES [1] JSON {"op": ..., ...}
C_RESPONSE: Final = "response"  # BYTES [1] JSON

STATUS_PAGE_LIMIT: Final = 1000
# control `describe`: "prefill_input" is one of these
INPUT_IDS: Final = "input_ids"
INPUT_BLOCK_KEYS: Final = "block_keys"
# the refusal (after "invalid_request: ") of a batch without ids by an engine that needs them
NEEDS_INPUT_IDS: Final = "input_ids are required by this engine"
