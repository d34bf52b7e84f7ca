# transformers' test files, copied for tests/test_transformers_common.py: imported from there, never collected
# on their own (their test classes are transformers' tests of the plain models).
collect_ignore_glob = ["test_*.py", "*/test_*.py", "*/*/test_*.py"]

