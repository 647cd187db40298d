"""An HTTP face for a simulated worker, so third-party routers (sglang-router, vllm-router) can be
benchmarked on the very engine core FlexLB's Triton workers run (`bench/compare_routers.sh`)."""
