"""The project's 40 tool-call cases: 16 simple, 8 multiple functions, 8 parallel,
4 parallel-multiple, 4 where no call is right.

Each case gives the tools offered, the user turn and the expected calls. An expected argument
lists every acceptable value; ``OMITTED`` in that list means the argument may be left out.
"""

from __future__ import annotations

from dataclasses import dataclass

OMITTED = "<omitted>"


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


S, INT, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
FUNCTIONS = {f["function"]["name"]: f for f in (
    _fn("get_weather", "Current weather for a city", {
        "city": S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _fn("convert_currency", "Convert an amount between currencies (ISO codes)", {
        "amount": N, "from_currency": S, "to_currency": S}, ["amount", "from_currency", "to_currency"]),
    _fn("book_table", "Book a restaurant table", {"restaurant": S, "people": INT, "time": S},
        ["restaurant", "people", "time"]),
    _fn("send_email", "Send an email", {"to": S, "subject": S, "body": S}, ["to", "subject"]),
    _fn("calculate_tip", "Tip for a bill", {"bill": N, "percent": N}, ["bill", "percent"]),
    _fn("search_recipes", "Find recipes with an ingredient", {"ingredient": S, "max_minutes": INT}, ["ingredient"]),
    _fn("set_reminder", "Remind the user after some minutes", {"text": S, "minutes": INT}, ["text", "minutes"]),
    _fn("get_stock_price", "Latest price of a stock ticker", {"symbol": S}, ["symbol"]),
    _fn("translate", "Translate text", {"text": S, "target_language": S}, ["text", "target_language"]),
    _fn("create_event", "Create a calendar event", {
        "title": S, "date": {"type": "string", "description": "YYYY-MM-DD"},
        "attendees": {"type": "array", "items": S}}, ["title", "date"]),
    _fn("get_distance", "Distance between two places", {
        "origin": S, "destination": S, "mode": {"type": "string", "enum": ["driving", "walking", "transit"]}},
        ["origin", "destination"]),
    _fn("play_song", "Play a song", {"title": S, "artist": S, "shuffle": B}, ["title"]),
)}


@dataclass(frozen=True)
class ToolCase:
    case_id: str
    category: str  # simple, multiple, parallel, parallel_multiple, no_call
    user: str
    tools: tuple[str, ...]  # names in FUNCTIONS
    expected: tuple[tuple[str, dict[str, list]], ...]  # (name, {arg: acceptable values})

    def tool_specs(self) -> list[dict]:
        return [FUNCTIONS[name] for name in self.tools]

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": "You are a helpful assistant. Use the tools when they help."},
                {"role": "user", "content": self.user}]


def _c(cid: str, cat: str, user: str, tools: tuple[str, ...], *calls: tuple[str, dict]) -> ToolCase:
    return ToolCase(cid, cat, user, tools, tuple(calls))


W = ("get_weather",)
CELSIUS = ["celsius", OMITTED]
CASES: tuple[ToolCase, ...] = (
    # simple: one function offered, one call
    _c("simple-01", "simple", "What's the weather in Paris?", W, ("get_weather", {"city": ["Paris", "Paris, France"], "unit": CELSIUS + ["fahrenheit"]})),
    _c("simple-02", "simple", "How hot is it in Phoenix right now, in fahrenheit?", W, ("get_weather", {"city": ["Phoenix", "Phoenix, AZ"], "unit": ["fahrenheit"]})),
    _c("simple-03", "simple", "Convert 250 US dollars to euros.", ("convert_currency",), ("convert_currency", {"amount": [250], "from_currency": ["USD"], "to_currency": ["EUR"]})),
    _c("simple-04", "simple", "How many yen is 19.99 British pounds?", ("convert_currency",), ("convert_currency", {"amount": [19.99], "from_currency": ["GBP"], "to_currency": ["JPY"]})),
    _c("simple-05", "simple", "Book a table for 4 at Luigi's at 19:30.", ("book_table",), ("book_table", {"restaurant": ["Luigi's", "Luigis"], "people": [4], "time": ["19:30", "7:30 pm", "7:30pm"]})),
    _c("simple-06", "simple", "Email bob@example.com with the subject 'Lunch' and say I'm running late.", ("send_email",), ("send_email", {"to": ["bob@example.com"], "subject": ["Lunch"], "body": ["I'm running late", "I'm running late.", "I am running late", OMITTED]})),
    _c("simple-07", "simple", "What's an 18 percent tip on a bill of 64.50?", ("calculate_tip",), ("calculate_tip", {"bill": [64.5], "percent": [18]})),
    _c("simple-08", "simple", "Find me recipes with chickpeas that take at most 30 minutes.", ("search_recipes",), ("search_recipes", {"ingredient": ["chickpeas", "chickpea"], "max_minutes": [30]})),
    _c("simple-09", "simple", "Remind me to call mom in 45 minutes.", ("set_reminder",), ("set_reminder", {"text": ["call mom", "Call mom"], "minutes": [45]})),
    _c("simple-10", "simple", "What's Apple's stock price? The ticker is AAPL.", ("get_stock_price",), ("get_stock_price", {"symbol": ["AAPL"]})),
    _c("simple-11", "simple", "Translate 'good morning' into German.", ("translate",), ("translate", {"text": ["good morning"], "target_language": ["German", "de"]})),
    _c("simple-12", "simple", "Put 'Team sync' in my calendar on 2025-03-14 with alice and bob.", ("create_event",), ("create_event", {"title": ["Team sync"], "date": ["2025-03-14"], "attendees": [["alice", "bob"], ["bob", "alice"]]})),
    _c("simple-13", "simple", "How far is it from Berlin to Potsdam by train?", ("get_distance",), ("get_distance", {"origin": ["Berlin"], "destination": ["Potsdam"], "mode": ["transit"]})),
    _c("simple-14", "simple", "Play Bohemian Rhapsody by Queen.", ("play_song",), ("play_song", {"title": ["Bohemian Rhapsody"], "artist": ["Queen", OMITTED], "shuffle": [False, OMITTED]})),
    _c("simple-15", "simple", "Walking distance from the Louvre to the Eiffel Tower?", ("get_distance",), ("get_distance", {"origin": ["Louvre", "the Louvre"], "destination": ["Eiffel Tower", "the Eiffel Tower"], "mode": ["walking"]})),
    _c("simple-16", "simple", "Weather in Tokyo in celsius please.", W, ("get_weather", {"city": ["Tokyo", "Tokyo, Japan"], "unit": ["celsius"]})),
    # multiple: several functions offered, one is right
    _c("multiple-01", "multiple", "What's the weather like in Madrid?", ("convert_currency", "get_weather", "set_reminder"), ("get_weather", {"city": ["Madrid"], "unit": CELSIUS + ["fahrenheit"]})),
    _c("multiple-02", "multiple", "Convert 100 euros to Swiss francs.", ("get_stock_price", "convert_currency", "translate"), ("convert_currency", {"amount": [100], "from_currency": ["EUR"], "to_currency": ["CHF"]})),
    _c("multiple-03", "multiple", "Remind me in 10 minutes to take the pizza out.", ("set_reminder", "create_event", "send_email"), ("set_reminder", {"text": ["take the pizza out", "Take the pizza out"], "minutes": [10]})),
    _c("multiple-04", "multiple", "Ticker MSFT: what's it trading at?", ("get_weather", "get_stock_price", "play_song"), ("get_stock_price", {"symbol": ["MSFT"]})),
    _c("multiple-05", "multiple", "Translate 'thank you' into Spanish.", ("translate", "search_recipes"), ("translate", {"text": ["thank you"], "target_language": ["Spanish", "es"]})),
    _c("multiple-06", "multiple", "Tip of 20 percent on 35 dollars?", ("calculate_tip", "convert_currency", "get_stock_price", "book_table"), ("calculate_tip", {"bill": [35], "percent": [20]})),
    _c("multiple-07", "multiple", "Book Sakura for 2 people at 8pm.", ("book_table", "create_event"), ("book_table", {"restaurant": ["Sakura"], "people": [2], "time": ["8pm", "20:00", "8:00 pm", "8 pm"]})),
    _c("multiple-08", "multiple", "Play Yesterday by the Beatles.", ("translate", "play_song", "set_reminder"), ("play_song", {"title": ["Yesterday"], "artist": ["The Beatles", "Beatles"], "shuffle": [False, OMITTED]})),
    # parallel: one function, several calls
    _c("parallel-01", "parallel", "What's the weather in Paris and in Rome?", W, ("get_weather", {"city": ["Paris"], "unit": CELSIUS + ["fahrenheit"]}), ("get_weather", {"city": ["Rome"], "unit": CELSIUS + ["fahrenheit"]})),
    _c("parallel-02", "parallel", "Stock prices for AAPL, GOOG and TSLA please.", ("get_stock_price",), ("get_stock_price", {"symbol": ["AAPL"]}), ("get_stock_price", {"symbol": ["GOOG"]}), ("get_stock_price", {"symbol": ["TSLA"]})),
    _c("parallel-03", "parallel", "Convert 10 USD to EUR and 10 USD to JPY.", ("convert_currency",), ("convert_currency", {"amount": [10], "from_currency": ["USD"], "to_currency": ["EUR"]}), ("convert_currency", {"amount": [10], "from_currency": ["USD"], "to_currency": ["JPY"]})),
    _c("parallel-04", "parallel", "Translate 'hello' into French and into Italian.", ("translate",), ("translate", {"text": ["hello"], "target_language": ["French", "fr"]}), ("translate", {"text": ["hello"], "target_language": ["Italian", "it"]})),
    _c("parallel-05", "parallel", "Remind me to stretch in 30 minutes and to drink water in 60 minutes.", ("set_reminder",), ("set_reminder", {"text": ["stretch"], "minutes": [30]}), ("set_reminder", {"text": ["drink water"], "minutes": [60]})),
    _c("parallel-06", "parallel", "Tips on a 50 dollar bill at 15 and at 20 percent?", ("calculate_tip",), ("calculate_tip", {"bill": [50], "percent": [15]}), ("calculate_tip", {"bill": [50], "percent": [20]})),
    _c("parallel-07", "parallel", "Weather in Oslo, Lima and Cairo in celsius.", W, ("get_weather", {"city": ["Oslo"], "unit": ["celsius"]}), ("get_weather", {"city": ["Lima"], "unit": ["celsius"]}), ("get_weather", {"city": ["Cairo"], "unit": ["celsius"]})),
    _c("parallel-08", "parallel", "Recipes with lentils and recipes with tofu.", ("search_recipes",), ("search_recipes", {"ingredient": ["lentils", "lentil"], "max_minutes": [OMITTED]}), ("search_recipes", {"ingredient": ["tofu"], "max_minutes": [OMITTED]})),
    # parallel-multiple: several functions, several calls
    _c("parmul-01", "parallel_multiple", "Weather in Vienna, and the price of NVDA.", ("get_weather", "get_stock_price"), ("get_weather", {"city": ["Vienna"], "unit": CELSIUS + ["fahrenheit"]}), ("get_stock_price", {"symbol": ["NVDA"]})),
    _c("parmul-02", "parallel_multiple", "Convert 5 GBP to USD and remind me to pay rent in 120 minutes.", ("convert_currency", "set_reminder"), ("convert_currency", {"amount": [5], "from_currency": ["GBP"], "to_currency": ["USD"]}), ("set_reminder", {"text": ["pay rent"], "minutes": [120]})),
    _c("parmul-03", "parallel_multiple", "Play Hallelujah and translate 'good night' into Portuguese.", ("play_song", "translate", "get_weather"), ("play_song", {"title": ["Hallelujah"], "artist": [OMITTED], "shuffle": [False, OMITTED]}), ("translate", {"text": ["good night"], "target_language": ["Portuguese", "pt"]})),
    _c("parmul-04", "parallel_multiple", "Book Nopa for 6 at 18:00 and email ann@example.com subject 'Dinner'.", ("book_table", "send_email"), ("book_table", {"restaurant": ["Nopa"], "people": [6], "time": ["18:00", "6pm", "6:00 pm"]}), ("send_email", {"to": ["ann@example.com"], "subject": ["Dinner"], "body": [OMITTED, "Dinner at Nopa at 18:00"]})),
    # no call is right
    _c("nocall-01", "no_call", "Tell me a short joke about cats.", W),
    _c("nocall-02", "no_call", "What is 12 times 12? Just answer.", ("get_stock_price", "convert_currency")),
    _c("nocall-03", "no_call", "Hi! How are you today?", ("set_reminder", "send_email")),
    _c("nocall-04", "no_call", "Write one sentence about the sea.", ("translate", "play_song")),
)

CATEGORY_COUNTS = {"simple": 16, "multiple": 8, "parallel": 8, "parallel_multiple": 4, "no_call": 4}
