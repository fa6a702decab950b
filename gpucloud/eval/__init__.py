"""The evaluation harness: task files in lm-evaluation-harness shapes, scored in-process by
the serving engine or by any OpenAI-compatible endpoint, with bootstrap confidence
intervals and a paired regression gate. Torch is imported only by the in-process backend."""
