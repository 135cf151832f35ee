# examples/frontend_program.py
"""An SGLang frontend program (``@sgl.function``) run against the server with ``sgl.RuntimeEndpoint``.
Start the server first: python -m sgl_loopkv.launch_server"""

import os

import sglang as sgl


@sgl.function
def trip_plan(s, city):
    s += sgl.user(f"I am visiting {city} for one day. Suggest one museum.")
    s += sgl.assistant(sgl.gen("museum", max_tokens=48, temperature=0))
    s += sgl.user("Is it good for children? Answer yes or no.")
    s += sgl.assistant(sgl.select("kids", choices=["yes", "no"]))


sgl.set_default_backend(sgl.RuntimeEndpoint(os.environ.get("URL", "http://127.0.0.1:30000")))
state = trip_plan.run(city="Paris")
print("museum:", state["museum"])
print("good for children:", state["kids"])
