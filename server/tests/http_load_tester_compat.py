"""Reads an llm-serving stream the way MindSpore performance_serving's load tester does.

Usage: python3 http_load_tester_compat.py PORT PROMPT MAX_NEW_TOKENS
Posts {"inputs", "parameters": {"max_new_tokens", "do_sample": "False", "return_full_text": "True"}}
to /models/llama2/generate_stream with `Connection: close`, reads the response with
requests' iter_lines(decode_unicode=True), takes json.loads(line)["data"][0]["generated_text"]
of every non-empty line, and prints a JSON summary for the Rust test to check (with
return_full_text the last line and the whole response start with the prompt).
"""
import json
import sys

import requests


def main():
    port, prompt, max_new = sys.argv[1], sys.argv[2], int(sys.argv[3])
    body = {"inputs": prompt,
            "parameters": {"max_new_tokens": max_new, "do_sample": "False", "return_full_text": "True"}}
    headers = {"Content-Type": "application/json", "Connection": "close"}
    url = f"http://localhost:{port}/models/llama2/generate_stream"
    resp = requests.request("POST", url, data=json.dumps(body), headers=headers, stream=True)
    texts = []
    for line in resp.iter_lines(decode_unicode=True):
        if line:
            texts.append(json.loads(line)["data"][0]["generated_text"])
    # Non-stream, as its return_all does.
    url_all = f"http://localhost:{port}/models/llama2/generate"
    whole = requests.request("POST", url_all, data=json.dumps(body), headers=headers)
    print(json.dumps({
        "status": resp.status_code,
        "chunked": resp.headers.get("Transfer-Encoding"),
        "texts": texts,
        "resp_text": texts[-1],
        "joined": "".join(texts[:-1]),
        "all_status": whole.status_code,
        "all_text": json.loads(whole.text)["generated_text"],
    }))


if __name__ == "__main__":
    main()
