# Not transformers' file: a stand-in for transformers' tests/test_pipeline_mixin.py, which the copied per-model
# test files import (their own test classes use it). tests/test_transformers_common.py does not run the pipeline
# tests (they read tests/utils/tiny_model_summary.json, tiny checkpoints on the Hub), so the name is all it needs.


class PipelineTesterMixin:
    pass
