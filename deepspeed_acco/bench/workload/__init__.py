"""What every run trains: the GPT-Neo presets (models), the text and its order (data), each method's DeepSpeed config (methods), and the precision (precision)."""
