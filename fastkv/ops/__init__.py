"""Native data-path ops (worker side only; `import fastkv` does not load this)."""
