"""Integrations with other libraries, each an extra of its own; `import fastjobs` imports none of them."""
