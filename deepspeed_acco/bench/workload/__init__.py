"""What every run trains: the GPT-Neo presets, the text and its order, each method's config, the precision."""
