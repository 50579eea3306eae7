"""Speed measured side by side with what a user would run instead: `python -m benchmarks.<name>`."""
