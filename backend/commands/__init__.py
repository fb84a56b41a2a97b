"""The `tritonllm` command and its subcommands, one module each. Libraries never import from here."""
