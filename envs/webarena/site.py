"""The small web sites shipped for WebArena tasks on a machine without the real ones: a shop and a forum.

    python -m envs.webarena.site --port 8080     # shop at /shop, forum at /forum

Server-rendered HTML (links, buttons, forms), so the accessibility tree carries the page's meaning.
State lives in sandboxes: every browser context carries a ``sandbox`` cookie, and
``POST /__sandbox/<name>/reset`` restores that sandbox's initial state, so episodes run side by side
and each starts from the same shop and forum. ``GET /__sandbox/<name>/state`` returns the state as JSON
(for program_html-style checks and tests).
"""

from __future__ import annotations

import argparse
import copy
import html
from typing import Any

from fastapi import FastAPI, Form, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse

PRODUCTS = [
    {"sku": "lp-100", "name": "Aster 13 Laptop", "category": "Laptops", "price": 899.0, "rating": 4.4},
    {"sku": "lp-200", "name": "Borealis 15 Laptop", "category": "Laptops", "price": 1249.0, "rating": 4.7},
    {"sku": "lp-300", "name": "Cobalt Chromebook 11", "category": "Laptops", "price": 329.0, "rating": 3.9},
    {"sku": "hp-100", "name": "Drift Wireless Headphones", "category": "Headphones", "price": 149.0, "rating": 4.2},
    {"sku": "hp-200", "name": "Echo Studio Headphones", "category": "Headphones", "price": 279.0, "rating": 4.8},
    {"sku": "hp-300", "name": "Fable Sport Earbuds", "category": "Headphones", "price": 59.0, "rating": 3.6},
    {"sku": "bk-100", "name": "Gardens of Stone (hardcover)", "category": "Books", "price": 24.5, "rating": 4.5},
    {"sku": "bk-200", "name": "Harbor Lights (paperback)", "category": "Books", "price": 12.99, "rating": 4.1},
    {"sku": "bk-300", "name": "Iron Orchard (paperback)", "category": "Books", "price": 15.0, "rating": 4.9},
    {"sku": "kt-100", "name": "Juniper Chef Knife", "category": "Kitchen", "price": 64.0, "rating": 4.6},
    {"sku": "kt-200", "name": "Kestrel Cast Iron Pan", "category": "Kitchen", "price": 45.0, "rating": 4.3},
    {"sku": "kt-300", "name": "Linden Pour-over Kettle", "category": "Kitchen", "price": 39.0, "rating": 4.0},
]
INITIAL: dict[str, Any] = {
    "cart": [],
    "orders": [
        {"id": 1001, "date": "2026-03-02", "items": ["Harbor Lights (paperback)"], "total": 12.99,
         "status": "Delivered"},
        {"id": 1002, "date": "2026-05-17", "items": ["Kestrel Cast Iron Pan", "Linden Pour-over Kettle"],
         "total": 84.0, "status": "Delivered"},
        {"id": 1003, "date": "2026-09-28", "items": ["Drift Wireless Headphones"], "total": 149.0,
         "status": "Shipped"},
    ],
    "reviews": {"lp-200": [{"author": "sam", "stars": 5, "text": "Fast and quiet."}],
                "hp-300": [{"author": "kim", "stars": 3, "text": "Fine for running, weak bass."}]},
    "wishlist": [],
    "forums": {
        "gardening": [
            {"id": 1, "title": "Tomatoes splitting after rain", "author": "fern", "votes": 12,
             "posts": [{"author": "fern", "text": "Any tips to stop my tomatoes splitting?"},
                       {"author": "moss", "text": "Water evenly and mulch well."}]},
            {"id": 2, "title": "Best cover crop for clay soil", "author": "clover", "votes": 7,
             "posts": [{"author": "clover", "text": "Thinking of winter rye. Thoughts?"}]},
        ],
        "retrocomputing": [
            {"id": 3, "title": "Restoring a 1984 home computer", "author": "byte", "votes": 25,
             "posts": [{"author": "byte", "text": "Recapped the board, it boots!"},
                       {"author": "pixel", "text": "Nice work. Which capacitors did you use?"},
                       {"author": "byte", "text": "Low-ESR ones from a kit."}]},
            {"id": 4, "title": "Floppy drive belt replacement", "author": "pixel", "votes": 9,
             "posts": [{"author": "pixel", "text": "A rubber band works in a pinch."}]},
        ],
        "cooking": [
            {"id": 5, "title": "Sourdough starter smells like acetone", "author": "rye", "votes": 18,
             "posts": [{"author": "rye", "text": "Is it dead?"}, {"author": "crumb", "text": "Feed it more often."}]},
        ],
    },
    "next_order": 1004,
    "next_thread": 6,
}
USER = "alex"

_sandboxes: dict[str, dict[str, Any]] = {}


def _state(request: Request) -> dict[str, Any]:
    name = request.cookies.get("sandbox", "default")
    if name not in _sandboxes:
        _sandboxes[name] = copy.deepcopy(INITIAL)
    return _sandboxes[name]


def _page(title: str, body: str, site: str) -> HTMLResponse:
    nav = ('<nav><a href="/shop/">Shop home</a> | <a href="/shop/cart">Cart</a> | <a href="/shop/orders">My orders</a>'
           ' | <a href="/shop/wishlist">Wishlist</a></nav>' if site == "shop" else
           '<nav><a href="/forum/">All forums</a> | <a href="/forum/submit">Submit a thread</a></nav>')
    return HTMLResponse(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
                        f"<body>{nav}<main><h1>{html.escape(title)}</h1>{body}</main></body></html>")


def _product(sku: str) -> dict[str, Any] | None:
    return next((p for p in PRODUCTS if p["sku"] == sku), None)


def _esc(value: Any) -> str:
    return html.escape(str(value))


def create_app() -> FastAPI:
    app = FastAPI(title="scalinginter WebArena sites")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "sandboxes": len(_sandboxes)}

    @app.post("/__sandbox/{name}/reset")
    def reset(name: str) -> dict[str, str]:
        _sandboxes[name] = copy.deepcopy(INITIAL)
        return {"sandbox": name}

    @app.delete("/__sandbox/{name}")
    def drop(name: str) -> dict[str, bool]:
        return {"deleted": _sandboxes.pop(name, None) is not None}

    @app.get("/__sandbox/{name}/state")
    def state(name: str) -> JSONResponse:
        return JSONResponse(_sandboxes.get(name) or copy.deepcopy(INITIAL))

    # ---- shop ----
    @app.get("/shop/")
    def shop_home(request: Request) -> HTMLResponse:
        categories = sorted({p["category"] for p in PRODUCTS})
        links = "".join(f'<li><a href="/shop/category/{c}">{c}</a></li>' for c in categories)
        form = ('<form action="/shop/search" method="get"><label for="q">Search products</label>'
                '<input id="q" name="q" type="search"><button type="submit">Search</button></form>')
        return _page("One Stop Shop", f"<p>Welcome back, {USER}.</p>{form}<h2>Categories</h2><ul>{links}</ul>", "shop")

    def _listing(products: list[dict[str, Any]]) -> str:
        rows = "".join(f'<li><a href="/shop/product/{p["sku"]}">{_esc(p["name"])}</a> - ${p["price"]:.2f}</li>'
                       for p in products)
        return f"<ul>{rows}</ul>" if rows else "<p>No products found.</p>"

    @app.get("/shop/category/{name}")
    def category(name: str, sort: str = "name") -> HTMLResponse:
        items = [p for p in PRODUCTS if p["category"] == name]
        items.sort(key=(lambda p: p["price"]) if sort == "price" else (lambda p: p["name"]))
        sorter = (f'<p>Sort by: <a href="/shop/category/{name}?sort=name">name</a> | '
                  f'<a href="/shop/category/{name}?sort=price">price</a></p>')
        return _page(name, sorter + _listing(items), "shop")

    @app.get("/shop/search")
    def search(q: str = "") -> HTMLResponse:
        words = q.lower().split()
        hits = [p for p in PRODUCTS if words and all(w in p["name"].lower() for w in words)]
        return _page(f"Search results for '{q}'", _listing(hits), "shop")

    @app.get("/shop/product/{sku}")
    def product(sku: str, request: Request) -> HTMLResponse:
        p = _product(sku)
        if p is None:
            return _page("Product not found", "<p>No such product.</p>", "shop")
        reviews = _state(request)["reviews"].get(sku, [])
        rlist = "".join(f"<li>{r['stars']} stars by {_esc(r['author'])}: {_esc(r['text'])}</li>" for r in reviews)
        body = (f'<p class="price">Price: ${p["price"]:.2f}</p><p>Rating: {p["rating"]} out of 5</p>'
                f'<p>Category: {p["category"]}</p>'
                f'<form action="/shop/cart/add" method="post"><input type="hidden" name="sku" value="{sku}">'
                f'<label for="qty">Quantity</label><input id="qty" name="qty" type="number" value="1" min="1">'
                f'<button type="submit">Add to cart</button></form>'
                f'<form action="/shop/wishlist/add" method="post"><input type="hidden" name="sku" value="{sku}">'
                f'<button type="submit">Add to wishlist</button></form>'
                f'<h2>Reviews</h2><ul>{rlist or "<li>No reviews yet.</li>"}</ul>'
                f'<form action="/shop/product/{sku}/review" method="post"><label for="stars">Stars</label>'
                f'<input id="stars" name="stars" type="number" min="1" max="5" value="5">'
                f'<label for="review">Your review</label><input id="review" name="text" type="text">'
                f'<button type="submit">Submit review</button></form>')
        return _page(p["name"], body, "shop")

    @app.post("/shop/cart/add")
    def cart_add(request: Request, sku: str = Form(...), qty: int = Form(1)) -> RedirectResponse:
        cart = _state(request)["cart"]
        for line in cart:
            if line["sku"] == sku:
                line["qty"] += max(qty, 1)
                break
        else:
            cart.append({"sku": sku, "qty": max(qty, 1)})
        return RedirectResponse("/shop/cart", status_code=303)

    @app.get("/shop/cart")
    def cart(request: Request) -> HTMLResponse:
        lines = _state(request)["cart"]
        total = sum(_product(line["sku"])["price"] * line["qty"] for line in lines)
        rows = "".join(f'<li>{_esc(_product(line["sku"])["name"])} x {line["qty"]}</li>' for line in lines)
        checkout = ('<form action="/shop/checkout" method="post"><button type="submit">Place order</button></form>'
                    if lines else "")
        return _page("Shopping cart", f"<ul>{rows or '<li>Your cart is empty.</li>'}</ul>"
                                      f"<p>Total: ${total:.2f}</p>{checkout}", "shop")

    @app.post("/shop/checkout")
    def checkout(request: Request) -> RedirectResponse:
        st = _state(request)
        if st["cart"]:
            total = sum(_product(line["sku"])["price"] * line["qty"] for line in st["cart"])
            st["orders"].append({"id": st["next_order"], "date": "2026-11-30",
                                 "items": [_product(line["sku"])["name"] for line in st["cart"]],
                                 "total": round(total, 2), "status": "Processing"})
            st["next_order"] += 1
            st["cart"] = []
        return RedirectResponse("/shop/orders", status_code=303)

    @app.get("/shop/orders")
    def orders(request: Request) -> HTMLResponse:
        rows = "".join(f'<tr><td><a href="/shop/orders/{o["id"]}">#{o["id"]}</a></td><td>{o["date"]}</td>'
                       f'<td>${o["total"]:.2f}</td><td>{o["status"]}</td></tr>' for o in _state(request)["orders"])
        return _page("My orders", "<table><tr><th>Order</th><th>Date</th><th>Total</th><th>Status</th></tr>"
                                  f"{rows}</table>", "shop")

    @app.get("/shop/orders/{oid}")
    def order(oid: int, request: Request) -> HTMLResponse:
        o = next((o for o in _state(request)["orders"] if o["id"] == oid), None)
        if o is None:
            return _page("Order not found", "<p>No such order.</p>", "shop")
        items = "".join(f"<li>{_esc(i)}</li>" for i in o["items"])
        return _page(f"Order #{oid}", f"<p>Placed on {o['date']}. Status: {o['status']}.</p><ul>{items}</ul>"
                                      f"<p>Total: ${o['total']:.2f}</p>", "shop")

    @app.post("/shop/wishlist/add")
    def wishlist_add(request: Request, sku: str = Form(...)) -> RedirectResponse:
        wl = _state(request)["wishlist"]
        if sku not in wl:
            wl.append(sku)
        return RedirectResponse("/shop/wishlist", status_code=303)

    @app.get("/shop/wishlist")
    def wishlist(request: Request) -> HTMLResponse:
        rows = "".join(f"<li>{_esc(_product(s)['name'])}</li>" for s in _state(request)["wishlist"])
        return _page("My wishlist", f"<ul>{rows or '<li>Your wishlist is empty.</li>'}</ul>", "shop")

    @app.post("/shop/product/{sku}/review")
    def review(sku: str, request: Request, stars: int = Form(5), text: str = Form("")) -> RedirectResponse:
        _state(request)["reviews"].setdefault(sku, []).append(
            {"author": USER, "stars": min(max(stars, 1), 5), "text": text})
        return RedirectResponse(f"/shop/product/{sku}", status_code=303)

    # ---- forum ----
    @app.get("/forum/")
    def forums(request: Request) -> HTMLResponse:
        st = _state(request)["forums"]
        rows = "".join(f'<li><a href="/forum/f/{name}">f/{name}</a> ({len(threads)} threads)</li>'
                       for name, threads in sorted(st.items()))
        return _page("Forums", f"<ul>{rows}</ul>", "forum")

    @app.get("/forum/f/{name}")
    def forum(name: str, request: Request, sort: str = "new") -> HTMLResponse:
        threads = list(_state(request)["forums"].get(name, []))
        threads.sort(key=(lambda t: -t["votes"]) if sort == "top" else (lambda t: -t["id"]))
        rows = "".join(f'<li><a href="/forum/f/{name}/{t["id"]}">{_esc(t["title"])}</a> by {_esc(t["author"])}, '
                       f'{t["votes"]} votes, {len(t["posts"]) - 1} replies</li>' for t in threads)
        sorter = f'<p>Sort: <a href="/forum/f/{name}?sort=new">new</a> | <a href="/forum/f/{name}?sort=top">top</a></p>'
        new = f'<p><a href="/forum/submit?forum={name}">New thread in f/{name}</a></p>'
        return _page(f"f/{name}", sorter + new + f"<ul>{rows}</ul>", "forum")

    def _thread(request: Request, name: str, tid: int) -> dict[str, Any] | None:
        return next((t for t in _state(request)["forums"].get(name, []) if t["id"] == tid), None)

    @app.get("/forum/f/{name}/{tid}")
    def thread(name: str, tid: int, request: Request) -> HTMLResponse:
        t = _thread(request, name, tid)
        if t is None:
            return _page("Thread not found", "<p>No such thread.</p>", "forum")
        posts = "".join(f"<article><p><b>{_esc(p['author'])}</b>: {_esc(p['text'])}</p></article>" for p in t["posts"])
        body = (f'<p>{t["votes"]} votes</p><form action="/forum/f/{name}/{tid}/upvote" method="post">'
                f'<button type="submit">Upvote</button></form>{posts}'
                f'<form action="/forum/f/{name}/{tid}/reply" method="post"><label for="reply">Reply</label>'
                f'<input id="reply" name="text" type="text"><button type="submit">Post reply</button></form>')
        return _page(t["title"], body, "forum")

    @app.post("/forum/f/{name}/{tid}/upvote")
    def upvote(name: str, tid: int, request: Request) -> RedirectResponse:
        t = _thread(request, name, tid)
        if t is not None:
            t["votes"] += 1
        return RedirectResponse(f"/forum/f/{name}/{tid}", status_code=303)

    @app.post("/forum/f/{name}/{tid}/reply")
    def reply(name: str, tid: int, request: Request, text: str = Form("")) -> RedirectResponse:
        t = _thread(request, name, tid)
        if t is not None and text.strip():
            t["posts"].append({"author": USER, "text": text.strip()})
        return RedirectResponse(f"/forum/f/{name}/{tid}", status_code=303)

    @app.get("/forum/submit")
    def submit_form(request: Request, forum: str = "") -> HTMLResponse:
        options = "".join(f'<option value="{n}"{" selected" if n == forum else ""}>{n}</option>'
                          for n in sorted(_state(request)["forums"]))
        body = (f'<form action="/forum/submit" method="post"><label for="forum">Forum</label>'
                f'<select id="forum" name="forum">{options}</select><label for="title">Title</label>'
                f'<input id="title" name="title" type="text"><label for="body">Body</label>'
                f'<input id="body" name="body" type="text"><button type="submit">Create thread</button></form>')
        return _page("Submit a thread", body, "forum")

    @app.post("/forum/submit")
    def submit(request: Request, forum: str = Form(...), title: str = Form(""),
               body: str = Form("")) -> RedirectResponse:
        st = _state(request)
        if forum in st["forums"] and title.strip():
            tid = st["next_thread"]
            st["next_thread"] += 1
            st["forums"][forum].append({"id": tid, "title": title.strip(), "author": USER, "votes": 1,
                                        "posts": [{"author": USER, "text": body.strip()}]})
            return RedirectResponse(f"/forum/f/{forum}/{tid}", status_code=303)
        return RedirectResponse("/forum/submit", status_code=303)

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from envs.server import KEEP_ALIVE_S

    parser = argparse.ArgumentParser(description="the shop and forum sites for local WebArena tasks")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="warning",
                timeout_keep_alive=KEEP_ALIVE_S)


if __name__ == "__main__":
    main()
