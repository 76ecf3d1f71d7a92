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

const check = (src: string, root: string) => {
  let pos = 0
  const fail = (what: string, at = pos): never => {
    const before = src.slice(0, at)
    const line = before.split("\n").length
    const column = at - before.lastIndexOf("\n")
    throw new GbnfSyntax(`${what} at line ${line}, column ${column}`)
  }
  const space = (newlines: boolean) => {
    while (pos < src.length) {
      const c = src[pos]!
      if (c === " " || c === "\t" || (newlines && (c === "\n" || c === "\r"))) pos++
      else if (c === "#") while (pos < src.length && src[pos] !== "\n" && src[pos] !== "\r") pos++
      else break
    }
  }
  const name = () => {
    const start = pos
    while (isWordChar(src[pos])) pos++
    if (pos === start)
      fail(`expected a rule name, got ${src[pos] === undefined ? "the end" : JSON.stringify(src[pos])}`)
    return src.slice(start, pos)
  }
  const hex = (digits: number) => {
    const part = src.slice(pos, pos + digits)
    if (part.length !== digits || !/^[0-9a-fA-F]+$/.test(part)) fail(`expected ${digits} hex digits`)
    pos += digits
  }
  // One character of a literal or class (an escape or a plain character); returns its code point.
  const char = (): number => {
    if (pos >= src.length) fail("unexpected end of input")
    if (src[pos] === "\\") {
      const escape = src[pos + 1]
      pos += 2
      switch (escape) {
        case "x":
          hex(2)
          return 0
        case "u":
          hex(4)
          return 0
        case "U":
          hex(8)
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
          return fail(`unknown escape "\\${escape ?? ""}"`, pos - 2)
      }
    }
    const code = src.codePointAt(pos)!
    pos += code > 0xffff ? 2 : 1
    return code
  }
  let depth = 0
  const integer = () => {
    const start = pos
    while (isDigit(src[pos])) pos++
    if (pos === start) fail("expected a number")
    return Number(src.slice(start, pos))
  }
  // Each element's size counts the copies llama.cpp's parser makes of it (a repetition {m,n} expands to n copies).
  const bounded = (size: number) =>
    size > maxGbnfExpansion ? fail(`the grammar expands to over ${maxGbnfExpansion} symbols`) : size
  const sequence = (nested: boolean): { elements: Array<Element>; size: number } => {
    const elements: Array<Element> = []
    let total = 0
    while (pos < src.length) {
      const c = src[pos]!
      let element: Element
      let size = 1
      if (c === '"') {
        pos++
        let chars = 0
        while (src[pos] !== '"') {
          if (pos >= src.length) fail("unexpected end of input in a literal")
          char()
          chars++
        }
        pos++
        size = Math.max(1, chars)
        element = chars === 0 ? { kind: "group", alternates: [[]] } : { kind: "char", nullable: false }
      } else if (c === "[") {
        pos++
        if (src[pos] === "^") pos++
        while (src[pos] !== "]") {
          if (pos >= src.length) fail("unexpected end of input in a character class")
          char()
          if (src[pos] === "-" && src[pos + 1] !== "]") {
            pos++
            char()
          }
        }
        pos++
        element = { kind: "char", nullable: false }
      } else if (c === ".") {
        pos++
        element = { kind: "char", nullable: false }
      } else if (isWordChar(c)) {
        const ref = name()
        element = { kind: "ref", name: ref }
        referenced.push({ name: ref, at: pos - ref.length })
      } else if (c === "(") {
        if (++depth > maxGbnfNesting) fail(`groups nest deeper than ${maxGbnfNesting}`)
        pos++
        space(true)
        const group = alternates(true)
        element = { kind: "group", alternates: group.alternates }
        size = group.size
        if (src[pos] !== ")") fail("expected )")
        pos++
        depth--
      } else if (c === "<") {
        return fail("token references (<…>) are not supported")
      } else {
        break
      }
      space(nested)
      // Repetition operators apply to the element just read.
      const op = src[pos]
      if (op === "*" || op === "?") {
        pos++
        element = { kind: "repeat", element, min: 0 }
      } else if (op === "+") {
        pos++
        element = { kind: "repeat", element, min: 1 }
      } else if (op === "{") {
        pos++
        space(nested)
        const min = integer()
        space(nested)
        let max: number | undefined = min
        if (src[pos] === ",") {
          pos++
          space(nested)
          max = isDigit(src[pos]) ? integer() : undefined
          space(nested)
        }
        if (src[pos] !== "}") fail("expected } after a repetition count")
        pos++
        if (min > maxGbnfRepetition || (max ?? 0) > maxGbnfRepetition) {
          fail(`a repetition count above ${maxGbnfRepetition}`)
        }
        if (max !== undefined && max < min) fail(`repetition {${min},${max}} has its maximum below its minimum`)
        element = { kind: "repeat", element, min }
        size *= Math.max(1, max ?? min + 1)
      }
      space(nested)
      elements.push(element)
      total = bounded(total + size)
    }
    return { elements, size: total }
  }
  const alternates = (nested: boolean): { alternates: Array<Array<Element>>; size: number } => {
    const first = sequence(nested)
    const all = [first.elements]
    let size = first.size
    while (src[pos] === "|") {
      pos++
      space(true)
      const next = sequence(nested)
      all.push(next.elements)
      size = bounded(size + next.size)
    }
    return { alternates: all, size }
  }

  let expansion = 0
  const rules = new Map<string, Array<Array<Element>>>()
  const referenced: Array<{ name: string; at: number }> = []
  space(true)
  while (pos < src.length) {
    const rule = name()
    space(false)
    if (src.slice(pos, pos + 3) !== "::=") fail(`expected ::= after rule ${rule}`)
    pos += 3
    space(true)
    const body = alternates(false)
    expansion = bounded(expansion + body.size)
    rules.set(rule, body.alternates)
    if (pos < src.length) {
      if (src[pos] === "\r") pos++
      if (src[pos] !== "\n") fail(`expected the end of rule ${rule}, got ${JSON.stringify(src[pos])}`)
    }
    space(true)
  }
  for (const ref of referenced) {
    if (!rules.has(ref.name)) fail(`undefined rule ${ref.name}`, ref.at)
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
