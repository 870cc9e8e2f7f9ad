"""Integrations with the tools people evaluate and scale with: lm-evaluation-harness (`lmeval`,
the `eval` extra). Nothing here is imported by `import remask`."""
