"""Built-in training text for the synthetic checkpoints' tokenizers (``toktrain``).

A few KB of varied English (prose, dialogue, code, numbers, punctuation) and a few lines with
accented, CJK and emoji characters, so the trained vocabulary has realistic words and multi-byte
characters that split across tokens. Changing this text changes every generated tokenizer: bump
``demo.DEMO_VERSION`` when you do.
"""

CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the porch.
A looped language model runs the same block of layers several times for every token.
Each pass refines the hidden state, and a small gate decides when the answer is good enough.
Tokens that are easy leave early; hard tokens keep thinking for another loop or two.
She opened the window, looked at the rain, and decided to stay home with a good book.
He said, "I will be there at nine o'clock," but he arrived a little after ten.
The meeting was moved to Thursday because the projector in room 204 was broken again.
What time does the train leave? It leaves at 7:45 in the morning from platform three.
In 1969, people watched on television as astronauts walked on the surface of the moon.
The recipe needs two cups of flour, one egg, a pinch of salt and three spoons of sugar.
Mix the butter and sugar until smooth, then add the eggs one at a time and stir gently.
Water boils at 100 degrees Celsius at sea level, but at lower temperatures on a mountain.
The library is open from Monday to Saturday, and it closes early on public holidays.
My grandmother grew tomatoes, beans, peppers and sunflowers in her small back garden.
Children were playing football in the park while their parents talked under the trees.
Please remember to save your work before you close the program or turn off the computer.
The server received the request, checked the token, and streamed the answer back quickly.
If the queue is full, new requests wait until a running request finishes and frees memory.
Every request has a prompt, a sampling temperature, a maximum number of tokens and a seed.
The scheduler groups work from many users into one batch so the device stays busy.
Good software is simple to read, easy to test, and honest about what it does not do.
Rivers carry water from the mountains to the sea, shaping valleys over thousands of years.
The museum shows paintings, old maps, musical instruments and a very large whale skeleton.
They walked along the beach at sunset and counted the boats returning to the harbour.
Would you like tea or coffee? I would like a glass of water, thank you very much.
Our team fixed the bug on Friday, wrote a new test, and shipped the release on Monday.
The weather today is cloudy with a chance of showers in the afternoon and a cool evening.
Birds build nests in spring, and the young ones learn to fly before the summer ends.
The history of mathematics includes counting, geometry, algebra and the idea of zero.
A prime number has exactly two divisors: one and itself. Seven, eleven and thirteen are prime.
The sum of 12 and 30 is 42, and the product of 6 and 7 is also 42.
Light travels about 300,000 kilometres per second, so sunlight reaches Earth in eight minutes.
When you are tired, a short walk outside often helps more than another cup of coffee.
The doctor asked how long the pain had lasted and whether it was worse in the morning.
Write a short story about a robot who learns to paint, and keep it under two hundred words.
Explain why the sky is blue in simple words that a ten year old child can understand.
Summarize the article in three sentences and list the most important numbers it mentions.
Translate the following sentence into French: the cat is sleeping on the warm blanket.
User: Can you help me plan a trip? Assistant: Of course. Where would you like to go?
User: What is the capital of Italy? Assistant: The capital of Italy is Rome.
User: Thanks! Assistant: You are welcome. Let me know if there is anything else I can do.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

if __name__ == "__main__":
    main()
{"name": "example", "values": [1, 2, 3], "enabled": true, "ratio": 0.25}
SELECT name, count(*) FROM users WHERE active = 1 GROUP BY name ORDER BY name;
The first rule of the club is that everyone brings a snack; the second rule is to share it.
Is it possible? Yes! It is possible, although it will take patience, time and some luck.
Numbers like 3.14159, 2.71828 and 1.41421 appear again and again in science and engineering.
On 2024-05-17 the temperature reached 31 C, the highest value recorded that month.
Keep calm, carry on, and always check the logs before you restart the production server.
The old lighthouse keeper climbed the stairs every night to light the lamp for the ships.
Music, art and stories help people remember who they are and where they come from.
Le café est très bon, et la crème brûlée est délicieuse. Où est la gare, s'il vous plaît?
Der Bär läuft über die Straße. Schöne Grüße aus München und einen schönen Tag!
El niño comió una manzana y después jugó en el jardín con su perro pequeño.
日本語の文章も少し含まれています。東京は大きな都市です。
中文也可以：今天天气很好，我们去公园散步吧。
Emoji make chats friendly 🙂 and sometimes confusing 🤔, but rockets 🚀 are always fun.
Math symbols: α + β = γ, ∑ x² ≥ 0, and π ≈ 3.14 are common in papers.
"""
