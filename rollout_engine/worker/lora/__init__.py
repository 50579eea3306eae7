"""LoRA adapters served unmerged: loading and checking PEFT adapters (`adapter`), their
device slots and the grouped delta of a step's linears (`slots`)."""
