"""The schemas and tools the structured-output checks use: ten response models (nested objects,
arrays, enums, optional fields, bounded numbers and strings) and two tools, each with a prompt.

Shared by ``benchmarks/structured_validity.py`` (the long run) and the e2e test (a few requests per
case). Strings and arrays are bounded so that a valid answer always fits in ``MAX_TOKENS``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

MAX_TOKENS = 400
Name = Field(min_length=1, max_length=24)
Word = Annotated[str, Field(min_length=1, max_length=24)]


class Person(BaseModel):
    name: str = Name
    age: int = Field(ge=0, le=120)


class Address(BaseModel):
    street: str = Name
    city: str = Name
    postcode: str = Field(pattern=r"^[0-9]{5}$")


class Contact(BaseModel):
    person: Person
    address: Address


class Item(BaseModel):
    name: str = Name
    quantity: int = Field(ge=1, le=100)
    price: float = Field(ge=0, le=10000)


class Order(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=4)
    express: bool


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confidence: float = Field(ge=0, le=1)


class Profile(BaseModel):
    username: str = Name
    bio: str | None = Field(default=None, max_length=60)
    website: str | None = Field(default=None, max_length=40)


class Event(BaseModel):
    title: str = Name
    day: int = Field(ge=1, le=31)
    month: Literal["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
    attendees: list[Word] = Field(max_length=5)


class Weather(BaseModel):
    city: str = Name
    temperature_c: float = Field(ge=-90, le=60)
    conditions: Literal["sunny", "cloudy", "rain", "snow", "storm"]


class Book(BaseModel):
    title: str = Name
    author: str = Name
    year: int = Field(ge=1000, le=2100)
    tags: list[Literal["fiction", "science", "history", "poetry"]] = Field(max_length=3)


class Company(BaseModel):
    name: str = Name
    ceo: Person
    employees: int = Field(ge=1, le=1_000_000)
    public: bool


class Task(BaseModel):
    id: int = Field(ge=0, le=9999)
    done: bool
    priority: Literal[1, 2, 3]
    subtasks: list[Word] = Field(max_length=3)


SCHEMAS: dict[str, tuple[type[BaseModel], str]] = {
    "person": (Person, "Describe a fictional person."),
    "contact": (Contact, "Give the contact details of a fictional person."),
    "order": (Order, "Create a small grocery order."),
    "sentiment": (Sentiment, "Classify the sentiment of: 'I loved the film, but the ending was weak.'"),
    "profile": (Profile, "Make a user profile for a keen gardener."),
    "event": (Event, "Plan a birthday party."),
    "weather": (Weather, "Report today's weather in Paris."),
    "book": (Book, "Describe a famous book."),
    "company": (Company, "Describe a made-up software company."),
    "task": (Task, "Create a to-do item for cleaning the kitchen."),
}


class GetWeather(BaseModel):
    city: str = Name
    unit: Literal["celsius", "fahrenheit"]


class SearchFlights(BaseModel):
    origin: str = Field(pattern=r"^[A-Z]{3}$")
    destination: str = Field(pattern=r"^[A-Z]{3}$")
    passengers: int = Field(ge=1, le=9)


TOOL_MODELS: dict[str, type[BaseModel]] = {"get_weather": GetWeather, "search_flights": SearchFlights}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                      "parameters": GetWeather.model_json_schema()}},
    {"type": "function", "function": {"name": "search_flights", "description": "Find flights between airports.",
                                      "parameters": SearchFlights.model_json_schema()}},
]
TOOL_PROMPT = "What is the weather like in Lisbon, and are there flights from LIS to JFK for two people?"
