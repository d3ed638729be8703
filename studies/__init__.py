"""Research code beside the package (not installed): study protocols driven by peftlab's public API."""
