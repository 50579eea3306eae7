"""The engine layer: `LLMEngine` wires the input processor (prompts into request specs), the
scheduler (core), the worker and the output processor, and steps them; the step executors, the
hooks around a step, landing and step failures, the verbs between steps, detokenization, scoring
and the KV connector's engine side live beside it."""
