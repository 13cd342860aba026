"""Text-to-speech models (``kind = "speech"``): mlx-audio's TTS families."""
