"""The engine layer: `LLMEngine` wires the input processor, the scheduler (core), the worker and
the output processor, and steps them; the step executors, detokenization, step failures, scoring
and the KV connector's engine side live beside it."""
