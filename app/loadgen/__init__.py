"""`flexlb bench`: replay a request trace (or synthetic load) against a running FlexLB gateway.

Pure parts (prompt synthesis, block-size check, request plans) live in `prompts.py` and `plan.py`;
the HTTP side (gateway discovery, the open-loop replay) in `gateway.py` and `replay.py`; the
command line in `cli.py`.
"""
