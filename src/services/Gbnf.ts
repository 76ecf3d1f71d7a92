/**
 * A GBNF grammar (llama.cpp's grammar format) checked in TypeScript before llama.cpp's parser sees it: the syntax
 * llama.cpp accepts (rules `name ::= …`, literals with \x \u \U \t \n \r escapes, character classes, `.`, groups,
 * `* + ? {m} {m,} {m,n}`, comments), every referenced rule defined, the root rule present, no left recursion, and
 * bounds that keep the parser's expansion small. Native code aborts (or, for `{3,1}`, allocates without end) on some
 * inputs it should refuse, so a request's grammar is refused here with a one-line reason instead.
 */

/** Repetition counts above this are refused (llama.cpp refuses 2,000 and more; every copy is expanded). */
export const maxGbnfRepetition = 1000
/** How deeply groups may nest. */
export const maxGbnfNesting = 64
/** Symbols the grammar may expand to, counting each repetition's copies (beyond it: refused). */
export const maxGbnfExpansion = 200_000

/** The problem with a grammar text, in words with its line and column, or undefined when llama.cpp can take it. */
export const gbnfProblem = (text: string, root = "root"): string | undefined => {
  try {
    check(text, root)
    return undefined
  } catch (error) {
    if (error instanceof GbnfSyntax) return error.message
    throw error
  }
}

class GbnfSyntax {
  constructor(readonly message: string) {}
}

type Element =
  | { readonly kind: "ref"; readonly name: string }
  | { readonly kind: "char"; readonly nullable: false }
  | { readonly kind: "group"; readonly alternates: ReadonlyArray<ReadonlyArray<Element>> }
  | { readonly kind: "repeat"; readonly element: Element; readonly min: number }

const isWordChar = (c: string | undefined) => c !== undefined && /[A-Za-z0-9-]/.test(c)
const isDigit = (c: string | undefined) => c !== undefined && c >= "0" && c <= "9"

/** An element read, with the symbols it expands to (each repetition's copies counted). */
interface Sized {
  readonly element: Element
  readonly size: number
}

/**
 * A recursive-descent reader of a GBNF text: `rules()` reads every rule, collecting the rule references (with where
 * they are) for `check` to resolve. Each step throws a GbnfSyntax naming the line and column of what it refuses.
 */
class GbnfReader {
  private pos = 0
  private depth = 0
  readonly referenced: Array<{ name: string; at: number }> = []
  constructor(private readonly src: string) {}

  fail(what: string, at = this.pos): never {
    const before = this.src.slice(0, at)
    const line = before.split("\n").length
    const column = at - before.lastIndexOf("\n")
    throw new GbnfSyntax(`${what} at line ${line}, column ${column}`)
  }

  private space(newlines: boolean) {
    const src = this.src
    while (this.pos < src.length) {
      const c = src[this.pos]!
      if (c === " " || c === "\t" || (newlines && (c === "\n" || c === "\r"))) this.pos++
      else if (c === "#") while (this.pos < src.length && src[this.pos] !== "\n" && src[this.pos] !== "\r") this.pos++
      else break
    }
  }

  private name() {
    const src = this.src
    const start = this.pos
    while (isWordChar(src[this.pos])) this.pos++
    if (this.pos === start)
      this.fail(`expected a rule name, got ${src[this.pos] === undefined ? "the end" : JSON.stringify(src[this.pos])}`)
    return src.slice(start, this.pos)
  }

  private hex(digits: number) {
    const part = this.src.slice(this.pos, this.pos + digits)
    if (part.length !== digits || !/^[0-9a-fA-F]+$/.test(part)) this.fail(`expected ${digits} hex digits`)
    this.pos += digits
  }

  /** One character of a literal or class (an escape or a plain character); returns its code point. */
  private char(): number {
    const src = this.src
    if (this.pos >= src.length) this.fail("unexpected end of input")
    if (src[this.pos] === "\\") {
      const escape = src[this.pos + 1]
      this.pos += 2
      switch (escape) {
        case "x":
          this.hex(2)
          return 0
        case "u":
          this.hex(4)
          return 0
        case "U":
          this.hex(8)
          return 0
        case "t":
        case "r":
        case "n":
        case "\\":
        case '"':
        case "[":
        case "]":
        case "-":
          return 0
        default:
          return this.fail(`unknown escape "\\${escape ?? ""}"`, this.pos - 2)
      }
    }
    const code = src.codePointAt(this.pos)!
    this.pos += code > 0xffff ? 2 : 1
    return code
  }

  private integer() {
    const start = this.pos
    while (isDigit(this.src[this.pos])) this.pos++
    if (this.pos === start) this.fail("expected a number")
    return Number(this.src.slice(start, this.pos))
  }

  /** Each element's size counts the copies llama.cpp's parser makes of it (a repetition {m,n} expands to n copies). */
  private bounded(size: number) {
    return size > maxGbnfExpansion ? this.fail(`the grammar expands to over ${maxGbnfExpansion} symbols`) : size
  }

  /** A literal `"…"`, at its opening quote. */
  private literal(): Sized {
    this.pos++
    let chars = 0
    while (this.src[this.pos] !== '"') {
      if (this.pos >= this.src.length) this.fail("unexpected end of input in a literal")
      this.char()
      chars++
    }
    this.pos++
    return {
      element: chars === 0 ? { kind: "group", alternates: [[]] } : { kind: "char", nullable: false },
      size: Math.max(1, chars)
    }
  }

  /** A character class `[…]` or `[^…]`, at its opening bracket. */
  private charClass(): Sized {
    const src = this.src
    this.pos++
    if (src[this.pos] === "^") this.pos++
    while (src[this.pos] !== "]") {
      if (this.pos >= src.length) this.fail("unexpected end of input in a character class")
      this.char()
      if (src[this.pos] === "-" && src[this.pos + 1] !== "]") {
        this.pos++
        this.char()
      }
    }
    this.pos++
    return { element: { kind: "char", nullable: false }, size: 1 }
  }

  /** A group `( … | … )`, at its opening parenthesis. */
  private group(): Sized {
    if (++this.depth > maxGbnfNesting) this.fail(`groups nest deeper than ${maxGbnfNesting}`)
    this.pos++
    this.space(true)
    const group = this.alternates(true)
    if (this.src[this.pos] !== ")") this.fail("expected )")
    this.pos++
    this.depth--
    return { element: { kind: "group", alternates: group.alternates }, size: group.size }
  }

  /** One element (a literal, class, `.`, rule reference or group), or undefined where the sequence ends. */
  private primary(): Sized | undefined {
    const c = this.src[this.pos]!
    if (c === '"') return this.literal()
    if (c === "[") return this.charClass()
    if (c === ".") {
      this.pos++
      return { element: { kind: "char", nullable: false }, size: 1 }
    }
    if (isWordChar(c)) {
      const ref = this.name()
      this.referenced.push({ name: ref, at: this.pos - ref.length })
      return { element: { kind: "ref", name: ref }, size: 1 }
    }
    if (c === "(") return this.group()
    if (c === "<") return this.fail("token references (<…>) are not supported")
    return undefined
  }

  /** A repetition count `{m}`, `{m,}` or `{m,n}`, at its opening brace: applied to the element just read. */
  private counted({ element, size }: Sized, nested: boolean): Sized {
    const src = this.src
    this.pos++
    this.space(nested)
    const min = this.integer()
    this.space(nested)
    let max: number | undefined = min
    if (src[this.pos] === ",") {
      this.pos++
      this.space(nested)
      max = isDigit(src[this.pos]) ? this.integer() : undefined
      this.space(nested)
    }
    if (src[this.pos] !== "}") this.fail("expected } after a repetition count")
    this.pos++
    if (min > maxGbnfRepetition || (max ?? 0) > maxGbnfRepetition) {
      this.fail(`a repetition count above ${maxGbnfRepetition}`)
    }
    if (max !== undefined && max < min) this.fail(`repetition {${min},${max}} has its maximum below its minimum`)
    return { element: { kind: "repeat", element, min }, size: size * Math.max(1, max ?? min + 1) }
  }

  /** Repetition operators apply to the element just read. */
  private repetition(read: Sized, nested: boolean): Sized {
    const op = this.src[this.pos]
    if (op === "*" || op === "?") {
      this.pos++
      return { element: { kind: "repeat", element: read.element, min: 0 }, size: read.size }
    }
    if (op === "+") {
      this.pos++
      return { element: { kind: "repeat", element: read.element, min: 1 }, size: read.size }
    }
    if (op === "{") return this.counted(read, nested)
    return read
  }

  private sequence(nested: boolean): { elements: Array<Element>; size: number } {
    const elements: Array<Element> = []
    let total = 0
    while (this.pos < this.src.length) {
      const read = this.primary()
      if (read === undefined) break
      this.space(nested)
      const { element, size } = this.repetition(read, nested)
      this.space(nested)
      elements.push(element)
      total = this.bounded(total + size)
    }
    return { elements, size: total }
  }

  private alternates(nested: boolean): { alternates: Array<Array<Element>>; size: number } {
    const first = this.sequence(nested)
    const all = [first.elements]
    let size = first.size
    while (this.src[this.pos] === "|") {
      this.pos++
      this.space(true)
      const next = this.sequence(nested)
      all.push(next.elements)
      size = this.bounded(size + next.size)
    }
    return { alternates: all, size }
  }

  /** Every rule `name ::= …` of the text, one a line, by name. */
  rules(): Map<string, Array<Array<Element>>> {
    const src = this.src
    let expansion = 0
    const rules = new Map<string, Array<Array<Element>>>()
    this.space(true)
    while (this.pos < src.length) {
      const rule = this.name()
      this.space(false)
      if (src.slice(this.pos, this.pos + 3) !== "::=") this.fail(`expected ::= after rule ${rule}`)
      this.pos += 3
      this.space(true)
      const body = this.alternates(false)
      expansion = this.bounded(expansion + body.size)
      rules.set(rule, body.alternates)
      if (this.pos < src.length) {
        if (src[this.pos] === "\r") this.pos++
        if (src[this.pos] !== "\n") this.fail(`expected the end of rule ${rule}, got ${JSON.stringify(src[this.pos])}`)
      }
      this.space(true)
    }
    return rules
  }
}

const check = (src: string, root: string) => {
  const reader = new GbnfReader(src)
  const rules = reader.rules()
  for (const ref of reader.referenced) {
    if (!rules.has(ref.name)) reader.fail(`undefined rule ${ref.name}`, ref.at)
  }
  if (!rules.has(root)) throw new GbnfSyntax(`no rule named ${root} (the root rule)`)
  leftRecursion(rules)
}

/** llama.cpp refuses left recursion (a rule that can reach itself before consuming a character). */
const leftRecursion = (rules: ReadonlyMap<string, ReadonlyArray<ReadonlyArray<Element>>>) => {
  const nullableRules = new Set<string>()
  const nullable = (e: Element): boolean =>
    e.kind === "ref"
      ? nullableRules.has(e.name)
      : e.kind === "char"
        ? false
        : e.kind === "repeat"
          ? e.min === 0 || nullable(e.element)
          : e.alternates.some((seq) => seq.every(nullable))
  for (let changed = true; changed;) {
    changed = false
    for (const [name, alts] of rules) {
      if (!nullableRules.has(name) && alts.some((seq) => seq.every(nullable))) {
        nullableRules.add(name)
        changed = true
      }
    }
  }
  // The rules each rule may start with (reached through nullable prefixes).
  const firsts = (alts: ReadonlyArray<ReadonlyArray<Element>>, out: Set<string>) => {
    for (const seq of alts) {
      for (const e of seq) {
        if (e.kind === "ref") out.add(e.name)
        else if (e.kind === "group") firsts(e.alternates, out)
        else if (e.kind === "repeat") firsts([[e.element]], out)
        if (!nullable(e)) break
      }
    }
    return out
  }
  const edges = new Map([...rules].map(([name, alts]) => [name, firsts(alts, new Set())]))
  const state = new Map<string, 1 | 2>()
  const visit = (name: string) => {
    state.set(name, 1)
    for (const next of edges.get(name) ?? []) {
      const s = state.get(next)
      if (s === 1) throw new GbnfSyntax(`left recursion through rule ${next} (llama.cpp does not support it)`)
      if (s === undefined) visit(next)
    }
    state.set(name, 2)
  }
  for (const name of rules.keys()) if (!state.has(name)) visit(name)
}
