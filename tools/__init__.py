"""echospec.tools"""
