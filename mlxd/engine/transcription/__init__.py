"""Speech-to-text models (``kind = "transcription"``): Whisper through mlx-audio."""
