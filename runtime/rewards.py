"""Task rewards computed from text. The default task rewards positive sentiment (VADER, bundled lexicon)."""


def sentiment(texts: list[str]) -> list[float]:
    """VADER compound score in [-1, 1] per text: > 0 reads positive, < 0 negative."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    analyzer = SentimentIntensityAnalyzer()
    return [analyzer.polarity_scores(text)["compound"] for text in texts]
